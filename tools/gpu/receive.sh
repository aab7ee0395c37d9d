#!/usr/bin/env bash
# On the GPU machine: keep chunk I of the staged bundle (carried as .dev/pI) in /tmp/payload, which
# survives between calls while the machine stays warm.
set -euo pipefail
i=${1:?usage: tools/gpu/receive.sh CHUNK_INDEX}
mkdir -p /tmp/payload
cp .dev/p"$i"/* /tmp/payload/
ls -la /tmp/payload
