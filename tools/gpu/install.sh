#!/usr/bin/env bash
# On the GPU machine, after every chunk was received: join and check the bundle, unpack vLLM into
# /tmp/site, install its dependency wheels and this project there (no package index needed).
# Afterwards: export PYTHONPATH=/tmp/site
set -euo pipefail
site=/tmp/site
cd /tmp/payload
n=$(cat chunks)
[[ $(ls chunk.* | wc -l) == "$n" ]] || { echo "have $(ls chunk.* | wc -l) of $n chunks: receive the others first" >&2; exit 2; }
cat chunk.* > payload.tar
echo "$(cat payload.sha)  payload.tar" | sha256sum -c --quiet
mkdir -p unpacked && tar -xf payload.tar -C unpacked && rm payload.tar
cat unpacked/parts/vllm026.tar.xz.* > vllm.tar.xz
echo "$(cat unpacked/parts/SHA256)  vllm.tar.xz" | sha256sum -c --quiet
mkdir -p "$site" && tar -I 'xz -T0' -xf vllm.tar.xz -C "$site" && rm vllm.tar.xz
python3 -m pip install -q --no-index --no-deps --target "$site" unpacked/deps/*.whl
cd - > /dev/null
python3 -m pip install -q --no-deps --no-build-isolation --target "$site" .
PYTHONPATH=$site python3 -c "import vllm, megatron_quads; print('vllm', vllm.__version__, 'megatron_quads ok')"
