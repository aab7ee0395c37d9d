"""The controller on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``): trainer ranks on two
nodes, the rollout engine on a third, a short GRPO run across them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_quads.controller.config import load_config

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

EXAMPLE = Path(__file__).parents[1] / "examples" / "embedded_default.yaml"


@pytest.fixture(scope="module")
def cluster():
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
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
