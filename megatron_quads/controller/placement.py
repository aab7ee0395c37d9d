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


class PlacementError(RuntimeError):
    """The Ray cluster cannot hold the run's placement groups; the message names what is missing."""


def _count(value: float, resource: str) -> str:
    """``4 GPUs``, ``1 CPU``, ``0.5 CPUs``."""
    return f"{value:g} {resource}{'' if value == 1 else 's'}"


def _resource_line(bundle: dict[str, float]) -> str:
    return ", ".join(_count(v, k) for k, v in bundle.items())


def placement_needs(cfg: RunConfig) -> list[tuple[str, list[dict[str, float]]]]:
    """The placement groups a run asks for, in creation order: ``(name, bundles)`` each."""
    p, world, engines = cfg.placement, cfg.trainer_world_size, cfg.rollout.num_workers
    if p.mode == "colocated":
        return [("trainer ranks and rollout engines", [_bundle(p.cpus_per_worker, p.trainer_gpus_per_worker)] * world)]
    return [("trainer ranks", [_bundle(p.cpus_per_worker, p.trainer_gpus_per_worker)] * world),
            ("rollout engines", [_bundle(p.cpus_per_worker, cfg.rollout.num_gpus_per_worker)] * engines)]


def _fits(bundle: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def check_feasible(groups: list[tuple[str, list[dict[str, float]]]], strategy: str, cluster: dict[str, float],
                   nodes: list[dict[str, float]]) -> None:
    """Raise :class:`PlacementError` when ``groups`` (``(name, bundles)``, all at once) can never be placed on
    a cluster of these total resources (``ray.cluster_resources()``) and alive nodes' resources: more of a
    resource than the cluster has, a bundle larger than every node (a bundle lives on one node), a
    STRICT_PACK group larger than every node, or a STRICT_SPREAD group with more bundles than nodes
    that can hold one. Placements that pass can still wait for resources other jobs hold."""
    fix = ("lower trainer_world_size, rollout.num_workers, placement.cpus_per_worker or the GPUs per worker, or run "
           "on a larger Ray cluster (placement.ray_address)")
    totals: dict[str, float] = {}
    for _, bundles in groups:
        for bundle in bundles:
            for key, value in bundle.items():
                totals[key] = totals.get(key, 0.0) + value
    missing = [f"{_count(v, k)}, the cluster has {cluster.get(k, 0.0):g}"
               for k, v in totals.items() if cluster.get(k, 0.0) + 1e-9 < v]
    if missing:
        asked = "; ".join(f"{name}: {len(b)} x ({_resource_line(b[0])})" for name, b in groups if b)
        raise PlacementError(f"the placement needs {' and '.join(missing)} ({asked}): {fix}")
    largest = {k: max((n.get(k, 0.0) for n in nodes), default=0.0) for k in totals}
    for name, bundles in groups:
        if not bundles:
            continue
        bundle = bundles[0]
        if not any(_fits(bundle, n) for n in nodes):
            node_has = ", ".join(_count(largest[k], k) for k in bundle)
            raise PlacementError(f"each bundle of the {name} ({_resource_line(bundle)}) must fit on one node, but no "
                                 f"node has that much (the most a node has: {node_has}): {fix}")
        if strategy == "STRICT_PACK":
            whole = {k: v * len(bundles) for k, v in bundle.items()}
            if not any(_fits(whole, n) for n in nodes):
                raise PlacementError(f"placement.strategy=STRICT_PACK puts all {len(bundles)} bundles of the {name} on one "
                                     f"node ({_resource_line(whole)}), but no node has that much: use PACK, or {fix}")
        if strategy == "STRICT_SPREAD":
            able = sum(_fits(bundle, n) for n in nodes)
            if able < len(bundles):
                raise PlacementError(f"placement.strategy=STRICT_SPREAD puts each of the {len(bundles)} bundles of the "
                                     f"{name} on a node of its own, but {able} node(s) can hold one: use SPREAD or PACK, "
                                     f"or {fix}")


def _alive_nodes() -> list[dict[str, float]]:
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive", n.get("alive", False))]


class Placement:
    """The placement groups of one run, and the slot of every trainer rank and rollout engine. What the run
    needs is checked against the cluster first (:func:`check_feasible`); ``timeout_s`` bounds the wait
    for resources that exist but are held elsewhere."""

    def __init__(self, cfg: RunConfig, timeout_s: float = 300.0) -> None:
        p, world, engines = cfg.placement, cfg.trainer_world_size, cfg.rollout.num_workers
        check_feasible(placement_needs(cfg), p.strategy, ray.cluster_resources(), _alive_nodes())
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
            try:
                roll_pg = self._create([_bundle(p.cpus_per_worker, gpus)] * engines, p.strategy, timeout_s)
            except BaseException:
                self.remove()
                raise
            self.trainer_slots = [_slot(train_pg, i, p.cpus_per_worker, p.trainer_gpus_per_worker) for i in range(world)]
            self.rollout_slots = [_slot(roll_pg, i, p.cpus_per_worker, gpus) for i in range(engines)]

    def _create(self, bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> PlacementGroup:
        pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise PlacementError(
                f"the Ray cluster could not place {len(bundles)} bundles of {bundles[0]} ({strategy}) within "
                f"{timeout_s:.0f} s, although it has the resources: other jobs or actors may hold them "
                f"(available now: {ray.available_resources()}). Wait for them, lower the worker counts or "
                "placement.cpus_per_worker, or add nodes"
            )
        self.groups.append(pg)
        return pg

    def remove(self) -> None:
        """Give the resources back to the cluster."""
        for pg in self.groups:
            remove_placement_group(pg)
        self.groups.clear()
