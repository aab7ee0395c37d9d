#!/usr/bin/env bash
# Stage the vLLM GPU bundle for a GPU machine reached only through calls that each carry at most
# ~64 MiB (working tree included): the bundle (vllm_gpu_bundle.sh OUT_DIR) is packed into one tar and
# cut into CHUNKS pieces, one per folder .dev/p<i>/ of the checkout, so each call carries one folder.
#
#   tools/gpu/stage.sh BUNDLE_DIR [CHUNKS]     (run in the repository root; default 4 chunks)
#
# Then, on the GPU machine, one call per chunk: `bash tools/gpu/receive.sh <i>` carrying .dev/p<i>,
# and a last call carrying the last chunk: `bash tools/gpu/receive.sh <last> && bash tools/gpu/install.sh`.
set -euo pipefail
bundle=${1:?usage: tools/gpu/stage.sh BUNDLE_DIR [CHUNKS]}
chunks=${2:-4}
[[ -f "$bundle/parts/SHA256" && -d "$bundle/deps" ]] || { echo "$bundle is not a vllm_gpu_bundle.sh output (parts/SHA256, deps/)" >&2; exit 2; }
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude
rm -rf .dev/p* .dev/payload.tar
mkdir -p .dev
tar -cf .dev/payload.tar -C "$bundle" parts deps
sha=$(sha256sum .dev/payload.tar | cut -d' ' -f1)
split -n "$chunks" -d -a 1 .dev/payload.tar .dev/chunk.
for f in .dev/chunk.*; do i=${f##*.}; mkdir -p ".dev/p$i"; mv "$f" ".dev/p$i/"; done
echo "$sha" > ".dev/p$((chunks - 1))/payload.sha"
echo "$chunks" > ".dev/p$((chunks - 1))/chunks"
rm .dev/payload.tar
du -sh .dev/p*
