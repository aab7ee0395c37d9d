#!/usr/bin/env bash
# On the GPU machine: join the parts tools/gpu/pack.sh made (carried in FOLDER as NAME.tar.* and
# NAME.sha256), check them, and unpack into DEST (e.g. FOLDER /tmp/sftparts, DEST /tmp/collapse: the
# packed directory lands in it under its own name).
#   bash tools/gpu/unpack.sh FOLDER NAME DEST
set -euo pipefail
folder=${1:?usage: tools/gpu/unpack.sh FOLDER NAME DEST}
name=${2:?usage: tools/gpu/unpack.sh FOLDER NAME DEST}
dest=${3:?usage: tools/gpu/unpack.sh FOLDER NAME DEST}
sums=$(realpath "$folder/$name.sha256")
trap 'rm -f "/tmp/$name.tar"' EXIT
cat "$folder/$name".tar.* > "/tmp/$name.tar"
(cd /tmp && sha256sum -c --quiet "$sums")
mkdir -p "$dest" && tar -xf "/tmp/$name.tar" -C "$dest"
echo "unpacked $name into $dest"
