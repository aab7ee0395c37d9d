#!/usr/bin/env bash
# On the GPU machine after install.sh: the GPU tests against the real vLLM engine, log in $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_vllm_gpu.py "$@" > "${OUT:-/tmp}/test_vllm_gpu.log" 2>&1
rc=$?
tail -n 25 "${OUT:-/tmp}/test_vllm_gpu.log"
exit $rc
