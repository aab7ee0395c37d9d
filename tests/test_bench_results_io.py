"""Benchmark results files keep the newest record of each key (benchmarks/results_io.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pytest
from results_io import load_records, save_record, write_records


def _record(date: str, value: float, **extra) -> dict:
    return {"date": date, "device": "CPU, 2 threads", "command": "python benchmarks/bench_x.py", "value": value, **extra}


def test_a_new_record_replaces_its_key_and_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    save_record(path, "cpu", _record("2026-11-01", 1.0))
    save_record(path, "gpu", _record("2026-11-02", 2.0))
    records = save_record(path, "cpu", _record("2026-11-03", 3.0))
    assert records == json.loads(path.read_text()) == load_records(path)
    assert list(records) == ["cpu", "gpu"]
    assert records["cpu"]["value"] == 3.0 and records["cpu"]["date"] == "2026-11-03"
    assert records["gpu"]["value"] == 2.0
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # no temporary file left behind


def test_the_markdown_view_is_rendered_from_every_record(tmp_path: Path) -> None:
    path, md = tmp_path / "x.json", tmp_path / "x.md"
    save_record(path, "a", _record("2026-11-01", 1.0))
    save_record(path, "b", _record("2026-11-02", 2.0), md, lambda records: " ".join(sorted(records)) + "\n")
    assert md.read_text() == "a b\n"
    with pytest.raises(ValueError, match="both markdown_path and render"):
        save_record(path, "b", _record("2026-11-02", 2.0), md)


def test_a_record_must_say_date_device_and_command(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    for field in ("date", "device", "command"):
        incomplete = _record("2026-11-01", 1.0)
        del incomplete[field]
        with pytest.raises(ValueError, match=field):
            save_record(path, "cpu", incomplete)
    assert not path.exists()  # nothing written
    with pytest.raises(ValueError, match="key"):
        write_records(path, {"": _record("2026-11-01", 1.0)})


def test_a_run_history_list_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps([_record("2026-11-01", 1.0)]))
    with pytest.raises(ValueError, match="not an object of records by key"):
        load_records(path)
    assert load_records(tmp_path / "missing.json") == {}


def test_every_results_file_holds_one_complete_record_per_key() -> None:
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    files = sorted(results.glob("*.json"))
    assert files
    for path in files:
        assert load_records(path), path  # an object of complete records, not a history


@pytest.mark.parametrize(("bench", "needs", "results_file", "views"), [
    ("bench_kernels", (), "kernels_gpu", {"kernels_gpu.md": lambda m, r: m.markdown_view(r)}),
    ("bench_nvfp4_cpu", (), "nvfp4_cpu", {"nvfp4_cpu.md": lambda m, r: m.markdown(r)}),
    ("bench_rac_cpu", (), "rac_cpu", {"rac_cpu.md": lambda m, r: m.markdown(r)}),
    ("bench_aqat_step", (), "aqat_step", {f"aqat_step_{p}.md": lambda m, r, p=p: m.markdown(r[p]) for p in ("cpu", "gpu")}),
    ("bench_engine", ("transformers",), "engine", {f"engine_{p}.md": lambda m, r, p=p: m.markdown(r[p]) for p in ("cpu", "gpu")}),
    ("bench_controller", ("ray",), "controller_cpu", {"controller_cpu.md": lambda m, r: m.markdown(r)}),
    ("bench_controller_gpu", ("ray", "transformers"), "controller_gpu", {"controller_gpu.md": lambda m, r: m.markdown(r)}),
    ("bench_weight_sync", (), "weight_sync", {"weight_sync_cpu.md": lambda m, r: m.markdown(r["cpu"])}),
    ("vllm_gpu_bench", (), "vllm", {"vllm_gpu.md": lambda m, r: m.markdown_records(r)}),
])
def test_each_markdown_view_is_its_benchmarks_rendering_of_the_json(bench: str, needs: tuple[str, ...],
                                                                     results_file: str, views: dict) -> None:
    import importlib

    for module in needs:
        pytest.importorskip(module)
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    module = importlib.import_module(bench)
    records = load_records(results / f"{results_file}.json")
    for md, render in views.items():
        assert render(module, records) == (results / md).read_text(), f"{md}: rerun python benchmarks/{bench}.py --render"
