"""Soak: a long GRPO run with rollout engines and the driver killed along the way ends where an
uninterrupted run ends.

    python benchmarks/bench_soak.py                      # 200 steps of the embedded default
    python benchmarks/bench_soak.py --steps 40 --kill-driver-at 25

Two runs of the same config (``megatron-quads train CONFIG``, checkpoints every
``--checkpoint-every`` steps) in fresh run directories:

- the reference, left alone;
- the soaked run: whenever its metrics show a step that is a multiple of ``--kill-engine-every``,
  one rollout worker process (and its children) is sent SIGKILL while the run goes on; when they
  show a step in ``--kill-driver-at``, the driver and every process it started (Ray included) get
  SIGKILL and the same command is started again, which resumes from the newest checkpoint.

Then every step's metrics are compared, except those that measure time or count restarts: equal
means bit-identical floats. The record goes to ``benchmarks/results/soak.json`` (the newest per
profile) and ``soak_<profile>.md``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from bench_device import record_stamp
from results_io import load_records, profile_markdown_path, publish, write_text_atomic

RESULTS = Path(__file__).parent / "results" / "soak.json"
REPO = Path(__file__).resolve().parents[1]
_NOT_COMPARED_PREFIXES = ("time/",)
_NOT_COMPARED = {"rollout_restarts"}


def _compared(key: str) -> bool:
    return not key.startswith(_NOT_COMPARED_PREFIXES) and not key.endswith("_s") and key not in _NOT_COMPARED


def _metrics(run_dir: Path) -> dict[int, dict]:
    """The last record of each step in ``run_dir/metrics.jsonl`` (a partly written last line is skipped)."""
    out: dict[int, dict] = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record.get("step"), int):
            out[record["step"]] = record
    return out


def _restarts(steps: dict[int, dict]) -> int:
    """Engine restarts over the run: ``rollout_restarts`` counts up within one launch of the driver
    and starts at 0 again after a relaunch."""
    total = previous = 0
    for step in sorted(steps):
        count = int(steps[step].get("rollout_restarts", 0))
        total += count - previous if count >= previous else count
        previous = count
    return total


def _command(config: str, run_dir: Path, steps: int, every: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_quads.cli", "train", config, f"run_dir={run_dir}", f"grpo.steps={steps}",
            f"checkpoint.every={every}", *overrides]


def _kill_tree(process: psutil.Process) -> int:
    """SIGKILL ``process`` and its descendants; how many were killed."""
    victims = [process, *process.children(recursive=True)]
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)
    return len(victims)


def _rollout_worker(driver: psutil.Process) -> psutil.Process | None:
    for p in driver.children(recursive=True):
        try:
            if "RolloutWorker" in " ".join(p.cmdline()):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _run(command: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)


def soak(args: argparse.Namespace, work: Path) -> dict:
    """Run the reference and the soaked run; return what happened and how their metrics compare."""
    reference_dir, soaked_dir = work / "reference", work / "soaked"
    start = time.perf_counter()
    reference = subprocess.run(_command(args.config, reference_dir, args.steps, args.checkpoint_every, args.override),
                               cwd=REPO, stdout=(work / "reference.log").open("w"), stderr=subprocess.STDOUT)
    reference_s = time.perf_counter() - start
    if reference.returncode:
        raise RuntimeError(f"the reference run failed (exit {reference.returncode}); see {work / 'reference.log'}")

    command = _command(args.config, soaked_dir, args.steps, args.checkpoint_every, args.override)
    events: list[dict] = []
    driver_kills = set(args.kill_driver_at)
    killed_at_step: set[int] = set()
    start = time.perf_counter()
    proc = _run(command, work / "soaked.log")
    launches = 1
    while True:
        code = proc.poll()
        steps = _metrics(soaked_dir)
        newest = max(steps, default=-1)
        if code is not None:
            if code == 0:
                break
            raise RuntimeError(f"the soaked run exited {code} outside a kill; see {work / 'soaked.log'}")
        if newest in driver_kills:
            driver_kills.discard(newest)
            killed = _kill_tree(psutil.Process(proc.pid))
            events.append({"after_step": newest, "killed": "driver", "processes": killed})
            proc.wait()
            proc = _run(command, work / "soaked.log")
            launches += 1
        elif newest > 0 and newest % args.kill_engine_every == 0 and newest not in killed_at_step:
            worker = _rollout_worker(psutil.Process(proc.pid))
            if worker is not None:
                killed_at_step.add(newest)
                events.append({"after_step": newest, "killed": "rollout worker", "processes": _kill_tree(worker)})
        time.sleep(0.2)
    soaked_s = time.perf_counter() - start

    expected, got = _metrics(reference_dir), _metrics(soaked_dir)
    differing = []
    for step in range(args.steps):
        a, b = expected.get(step), got.get(step)
        if a is None or b is None:
            differing.append({"step": step, "missing_in": "reference" if a is None else "soaked"})
            continue
        keys = sorted(k for k in a.keys() | b.keys() if _compared(k))
        bad = [k for k in keys if a.get(k) != b.get(k)]
        if bad:
            differing.append({"step": step, "keys": bad[:5]})
    return {
        "steps": args.steps, "reference_s": reference_s, "soaked_s": soaked_s, "launches": launches, "events": events,
        "engine_kills": sum(e["killed"] == "rollout worker" for e in events),
        "driver_kills": sum(e["killed"] == "driver" for e in events),
        "restarts_reported": _restarts(got),
        "compared_keys": len([k for k in expected.get(0, {}) if _compared(k)]),
        "steps_equal": args.steps - len(differing), "differing": differing[:10],
    }


def markdown(record: dict) -> str:
    """The record as Markdown."""
    r = record["results"]
    verdict = "equal" if r["steps_equal"] == r["steps"] else f"{r['steps'] - r['steps_equal']} steps differ"
    lines = [
        f"# Soak: {r['steps']} steps with engines and the driver killed ({record['date']}, {record['device']})", "",
        f"Command: `{record['command']}`.", "",
        "| | value |", "|---|---:|",
        f"| steps | {r['steps']} |",
        f"| rollout workers killed | {r['engine_kills']} |",
        f"| driver killed (then resumed) | {r['driver_kills']} |",
        f"| engine restarts in the kept metrics (`rollout_restarts`; steps redone after a resume keep the "
        f"relaunched driver's count) | {r['restarts_reported']} |",
        f"| reference run, seconds | {r['reference_s']:.0f} |",
        f"| soaked run, seconds (all launches) | {r['soaked_s']:.0f} |",
        f"| metrics compared per step | {r['compared_keys']} (all but time and restart counts) |",
        f"| steps whose metrics equal the reference's bit for bit | {r['steps_equal']} of {r['steps']} ({verdict}) |",
    ]
    if r["differing"]:
        lines += ["", "First differing steps: " + "; ".join(json.dumps(d) for d in r["differing"])]
    lines += ["", "Kills: " + "; ".join(f"{e['killed']} after step {e['after_step']}" for e in r["events"])]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the soak and store its record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/embedded_default.yaml")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--kill-engine-every", type=int, default=20)
    parser.add_argument("--kill-driver-at", type=int, nargs="*", default=[75, 145])
    parser.add_argument("--profile", default="cpu", help="the record's name in the results file")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown views from the JSON file")
    parser.add_argument("override", nargs="*", help="extra key=value overrides for both runs")
    args = parser.parse_args()
    if args.render:
        for profile, record in load_records(args.out).items():
            write_text_atomic(profile_markdown_path(args.out, profile), markdown(record))
        return
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        results = soak(args, Path(tmp))
    record = {**record_stamp(), "results": results}
    publish(args.out, args.profile, record, markdown(record))


if __name__ == "__main__":
    main()
