"""Test-only storage faults in every process of a run: the driver, its Ray workers and the processes
they fork import this module at start-up when this folder is first on PYTHONPATH (Python imports
``sitecustomize`` by itself).

``MEGATRON_QUADS_TEST_FAULT`` is a JSON object:

- ``{"open": SUBSTRING, "errno": N}``: opening a path that contains SUBSTRING for writing raises
  ``OSError(N)`` naming it;
- ``{"write": SUBSTRING, "contains": TEXT}``: an ``os.write`` to a file whose path contains SUBSTRING,
  of data containing TEXT, writes half the bytes and returns that count (the disk filled mid-write);
  the next such write raises ``OSError(ENOSPC)``.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os

_SPEC = json.loads(os.environ.get("MEGATRON_QUADS_TEST_FAULT") or "null")


def _install(spec: dict) -> None:
    if "open" in spec:
        real_open = io.open
        code = int(spec.get("errno", errno.ENOSPC))

        def faulty_open(file, mode="r", *args, **kwargs):
            writing = any(flag in mode for flag in "wax+")
            if writing and not isinstance(file, int) and spec["open"] in os.fsdecode(file):
                raise OSError(code, os.strerror(code), os.fsdecode(file))
            return real_open(file, mode, *args, **kwargs)

        io.open = builtins.open = faulty_open
    if "write" in spec:
        real_write = os.write
        cut = []

        def faulty_write(fd, data):
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = ""
            if spec["write"] in path and spec.get("contains", "").encode() in bytes(data):
                if cut:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                cut.append(True)
                return real_write(fd, bytes(data)[: len(data) // 2])
            return real_write(fd, data)

        os.write = faulty_write


if isinstance(_SPEC, dict):
    _install(_SPEC)
