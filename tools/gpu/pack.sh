#!/usr/bin/env bash
# On the GPU machine: put directory SRC into $OUT as NAME.tar.00, .01, ... (15 MiB parts: a call brings back
# files of at most 16 MiB, 8 of them, 64 MiB in all) and NAME.sha256, so that what one machine made (an SFT
# checkpoint) outlives the machine. Here: `cat NAME.tar.* > NAME.tar && sha256sum -c NAME.sha256`; to
# carry it to a later machine, keep the parts and NAME.sha256 in git-ignored folders of the checkout that
# each fit a call's 64 MiB beside the checkout, copy them into one folder there over as many calls, and run
# tools/gpu/unpack.sh on it (DEVELOPERS.md).
#   bash tools/gpu/pack.sh SRC NAME
set -euo pipefail
src=${1:?usage: tools/gpu/pack.sh SRC NAME}
name=${2:?usage: tools/gpu/pack.sh SRC NAME}
out=${OUT:?set OUT to the folder whose files the call brings back}
tar -cf "/tmp/$name.tar" -C "$(dirname "$src")" "$(basename "$src")"
(cd /tmp && sha256sum "$name.tar") > "$out/$name.sha256"
split -b 15M -d "/tmp/$name.tar" "$out/$name.tar."
rm "/tmp/$name.tar"
parts=$(ls "$out/$name".tar.* | wc -l)
(( parts <= 7 )) || { echo "$name: $parts parts, more than one call brings back: pack less" >&2; exit 1; }
ls -la "$out"
