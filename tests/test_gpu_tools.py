"""The GPU machine's shell tools that run anywhere: packing a directory into parts a call can bring back,
and unpacking them, checked, on a later machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).parents[1] / "tools" / "gpu"


def _run(script: str, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"OUT": str(out)} if out else {})}
    return subprocess.run(["bash", str(TOOLS / script), *args], env=env, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("split") is None or shutil.which("sha256sum") is None, reason="needs coreutils")
def test_a_packed_directory_comes_back_in_parts_and_unpacks_to_the_same_bytes(tmp_path: Path) -> None:
    source = tmp_path / "sft" / "checkpoint"
    source.mkdir(parents=True)
    payload = os.urandom(20 * 2**20)
    (source / "weights.bin").write_bytes(payload)
    (source / "model_config.json").write_text('{"num_layers": 8}')
    out = tmp_path / "out"
    out.mkdir()
    name = f"sft_{os.getpid()}"
    packed = _run("pack.sh", str(tmp_path / "sft"), name, out=out)
    assert packed.returncode == 0, packed.stderr
    parts = sorted(out.glob(f"{name}.tar.*"))
    assert len(parts) == 2 and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    dest = tmp_path / "machine"
    unpacked = _run("unpack.sh", str(out), name, str(dest))
    assert unpacked.returncode == 0, unpacked.stderr
    assert (dest / "sft" / "checkpoint" / "weights.bin").read_bytes() == payload
    assert (dest / "sft" / "checkpoint" / "model_config.json").read_text() == '{"num_layers": 8}'

    damaged = bytearray(parts[1].read_bytes())
    damaged[100] ^= 1
    parts[1].write_bytes(bytes(damaged))
    again = _run("unpack.sh", str(out), name, str(tmp_path / "other"))
    assert again.returncode != 0 and "FAILED" in again.stdout + again.stderr
    assert not (tmp_path / "other").exists() and not Path(f"/tmp/{name}.tar").exists()
