"""Where the workers run: Ray placement groups for the trainer and rollout worker groups.

Two layouts (``placement.mode``):
- ``disaggregated``: one placement group of ``trainer_world_size`` bundles for the trainer ranks and
  one of ``rollout.num_workers`` bundles for the engines; each side owns its GPUs.
- ``colocated``: one placement group of ``trainer_world_size`` bundles; trainer rank ``i`` and rollout
  engine ``i`` share bundle ``i`` (so, on GPUs, one device), each asking for half of the bundle's
  resources so Ray places both there. The engine releases its GPU memory while the trainer trains.

On CPU the bundles hold CPU shares only; the same code path runs, which is what the tests exercise.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_quads.controller.config import RunConfig


@dataclass(frozen=True)
class Slot:
    """The resources and bundle one actor is scheduled with."""

    num_cpus: float
    num_gpus: float
    strategy: PlacementGroupSchedulingStrategy

    def options(self) -> dict:
        """Keyword arguments for ``ActorClass.options``."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "scheduling_strategy": self.strategy}


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}


def _slot(pg: PlacementGroup, index: int, cpus: float, gpus: float) -> Slot:
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
    return Slot(num_cpus=cpus, num_gpus=gpus, strategy=strategy)


class Placement:
    """The placement groups of one run, and the slot of every trainer rank and rollout engine."""

    def __init__(self, cfg: RunConfig, timeout_s: float = 300.0) -> None:
        p, world, engines = cfg.placement, cfg.trainer_world_size, cfg.rollout.num_workers
        self.groups: list[PlacementGroup] = []
        if p.mode == "colocated":
            gpus = p.trainer_gpus_per_worker
            pg = self._create([_bundle(p.cpus_per_worker, gpus)] * world, p.strategy, timeout_s)
            # both actors of a bundle ask for half of it: Ray puts them on the same CPU share / GPU
            self.trainer_slots = [_slot(pg, i, p.cpus_per_worker / 2, gpus / 2) for i in range(world)]
            self.rollout_slots = [_slot(pg, i, p.cpus_per_worker / 2, gpus / 2) for i in range(engines)]
        else:
            train_pg = self._create([_bundle(p.cpus_per_worker, p.trainer_gpus_per_worker)] * world, p.strategy, timeout_s)
            gpus = cfg.rollout.num_gpus_per_worker
            roll_pg = self._create([_bundle(p.cpus_per_worker, gpus)] * engines, p.strategy, timeout_s)
            self.trainer_slots = [_slot(train_pg, i, p.cpus_per_worker, p.trainer_gpus_per_worker) for i in range(world)]
            self.rollout_slots = [_slot(roll_pg, i, p.cpus_per_worker, gpus) for i in range(engines)]

    def _create(self, bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> PlacementGroup:
        pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise RuntimeError(
                f"the Ray cluster could not place {len(bundles)} bundles of {bundles[0]} ({strategy}) within "
                f"{timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}. Lower the worker counts or "
                "placement.cpus_per_worker, or add nodes"
            )
        self.groups.append(pg)
        return pg

    def remove(self) -> None:
        """Give the resources back to the cluster."""
        for pg in self.groups:
            remove_placement_group(pg)
        self.groups.clear()
