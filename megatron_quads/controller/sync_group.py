"""A process group of its own for weight broadcast: one weight-sending trainer rank (rank 0) and
every rollout engine (ranks 1..n). Each sender has its own group, so the senders broadcast
concurrently and no sender receives another's buffers.

The trainers' default process group stays untouched: each group is built directly on a TCPStore
hosted by its sender, with NCCL when everyone holds a GPU and gloo on CPU (the tests use gloo; the
NCCL path is the same code and has not been run). Engines that restart get new groups: every member
joins a fresh store (new port, new generation prefix).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class WeightSyncGroup:
    """Rank ``rank`` of ``world`` in the weight-broadcast group; rank 0 is the sender."""

    def __init__(self, address: str, port: int, rank: int, world: int, generation: int, device: torch.device,
                 timeout_s: float = 300.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout)
        store = dist.PrefixStore(f"megatron_quads/weight_sync/{generation}", self._store)
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, world)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world, timeout)
        self.rank, self.world, self.device = rank, world, device

    def broadcast(self, buffer: torch.Tensor) -> torch.Tensor:
        """Rank 0 sends ``buffer``; the others receive into theirs (same size and dtype)."""
        if buffer.device.type != self.device.type:
            raise ValueError(f"weight-sync group on {self.device.type} got a buffer on {buffer.device}")
        self.group.broadcast(buffer, 0).wait()
        return buffer
