"""The controller on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``): trainer ranks on two
nodes, the rollout engine on a third, a short GRPO run across them; a node lost mid-run."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from megatron_quads.controller.config import load_config

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

EXAMPLE = Path(__file__).parents[1] / "examples" / "embedded_default.yaml"


@pytest.fixture(scope="module")
def cluster():
    # a node whose raylet stops answering is declared dead within ~2 s, so a lost node shows quickly
    health = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": health})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


def test_trainer_ranks_on_two_nodes_and_the_engine_on_a_third(cluster, tmp_path: Path) -> None:
    from megatron_quads.controller.run import run

    head, nodes = cluster
    # one CPU per node and one CPU per bundle: the two trainer bundles take two nodes, the engine's the third
    cfg = load_config(EXAMPLE, [
        f"run_dir={tmp_path}", "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.responses_per_prompt=2",
        "rollout.max_new_tokens=4", "rollout.engine=torch", "logging.wandb=disabled", "checkpoint.every=0",
        "trainer_world_size=2", "placement.cpus_per_worker=1", "placement.strategy=SPREAD",
        f"placement.ray_address={head.address}",
    ])
    records = [json.loads(line) for line in run(cfg).read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["train/update_successful"] == 1.0 for r in records)
    placed = json.loads((tmp_path / "placement.json").read_text())
    trainer_nodes, engine_nodes = set(placed["trainer_ranks"]), set(placed["rollout_engines"])
    assert len(trainer_nodes) == 2 and len(engine_nodes) == 1
    assert not trainer_nodes & engine_nodes
    assert trainer_nodes | engine_nodes == {node.node_id for node in nodes}


def _remove_engine_node_after_step_0(cluster, nodes: list, run_dir: Path, removed: list) -> None:
    deadline = time.monotonic() + 300
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.1)
    engine_node = json.loads((run_dir / "placement.json").read_text())["rollout_engines"][0]
    node = next(n for n in nodes if n.node_id == engine_node)
    cluster.remove_node(node, allow_graceful=False)
    removed.append(node)


def test_a_run_whose_engine_node_is_lost_restarts_the_engine_on_a_spare_node(cluster, tmp_path: Path) -> None:
    """The rollout engine's node dies after step 0: the engine's bundle moves to the spare node, the
    engine restarts there (re-synced), and the run finishes every step. Last in the module: it
    takes a node away (and adds a fresh one back)."""
    from megatron_quads.controller.run import run

    head, nodes = cluster
    cfg = load_config(EXAMPLE, [
        f"run_dir={tmp_path}", "grpo.steps=4", "grpo.prompts_per_step=2", "grpo.responses_per_prompt=2",
        "rollout.max_new_tokens=4", "rollout.engine=torch", "rollout.timeout_s=60", "logging.wandb=disabled",
        "checkpoint.every=0", "trainer_world_size=1", "placement.cpus_per_worker=1", "placement.strategy=SPREAD",
        f"placement.ray_address={head.address}",
    ])
    removed: list = []
    killer = threading.Thread(target=_remove_engine_node_after_step_0, args=(head, nodes, tmp_path, removed), daemon=True)
    killer.start()
    try:
        records = [json.loads(line) for line in run(cfg).read_text().splitlines()]
    finally:
        killer.join(timeout=300)
        for node in removed:
            nodes.remove(node)
            nodes.append(head.add_node(num_cpus=1))
        head.wait_for_nodes()
    assert removed, "the engine's node was not removed"
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["train/update_successful"] == 1.0 for r in records)
    assert records[-1]["rollout_restarts"] >= 1  # a running count


def test_a_run_without_a_ray_address_starts_its_own_instance_beside_a_running_cluster(cluster) -> None:
    """``placement.ray_address`` unset means a local Ray instance of its own, even while another
    cluster runs on the machine (a plain ``ray.init`` would join that one and refuse ``num_cpus``)."""
    import os
    import subprocess
    import sys

    code = ("import ray\nfrom megatron_quads.controller.config import load_config\n"
            "from megatron_quads.controller.run import _init_ray\n"
            f"_init_ray(load_config({str(EXAMPLE)!r}, []))\n"
            "print(int(ray.cluster_resources()['CPU']), len(ray.nodes()))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    cpus, nodes = map(int, result.stdout.split()[-2:])
    assert (cpus, nodes) == (max(2, os.cpu_count() or 2), 1)  # not the fixture's 3 one-CPU nodes
