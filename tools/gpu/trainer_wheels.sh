#!/usr/bin/env bash
# Add to a vLLM GPU bundle (../shared/tools/vllm_gpu_bundle.sh OUT_DIR) the wheels the trainer side
# needs on a GPU machine whose image lacks them (Python 3.12, no package index): Ray, Megatron-Core,
# OmegaConf, Hugging Face datasets and what of their dependencies such an image does not hold. Versions
# are the ones `make install` resolves here, so the GPU runs the code the CPU suite tests.
#
#   tools/gpu/trainer_wheels.sh BUNDLE_DIR      (then tools/gpu/stage.sh BUNDLE_DIR 6)
set -euo pipefail
bundle=${1:?usage: tools/gpu/trainer_wheels.sh BUNDLE_DIR}
[[ -d "$bundle/deps" ]] || { echo "$bundle has no deps/: build it with vllm_gpu_bundle.sh first" >&2; exit 2; }
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$bundle/deps" \
    ray==2.60.0 megatron-core==0.16.1 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 datasets==5.2.0 \
    multiprocess==0.70.19 filelock==4.3.1
du -sh "$bundle/deps"
