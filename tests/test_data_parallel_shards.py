"""How the controller splits a batch over the trainer ranks (``data_parallel_shards``)."""

from __future__ import annotations

import pytest
import torch

from megatron_quads.controller.batch import data_parallel_shards


def _batch(sequences: int) -> dict[str, torch.Tensor]:
    tokens = torch.arange(sequences * 5).view(sequences, 5)
    return {"tokens": tokens, "advantages": torch.arange(sequences, dtype=torch.float32)}


def test_sequences_the_replicas_do_not_divide_give_every_replica_a_piece_the_first_ones_longer() -> None:
    batch = _batch(6)
    shards = data_parallel_shards(batch, [(rank, 4) for rank in range(4)])
    assert [len(s["tokens"]) for s in shards] == [2, 2, 1, 1]
    assert torch.equal(torch.cat([s["tokens"] for s in shards]), batch["tokens"])  # contiguous, in order
    for s in shards:  # every tensor of a piece holds the same sequences
        assert torch.equal(s["advantages"], s["tokens"][:, 0].float() / 5)


def test_the_ranks_of_one_replica_get_the_same_piece() -> None:
    batch = _batch(5)
    dp = [(0, 2), (0, 2), (1, 2), (1, 2)]  # TP 2 x DP 2
    shards = data_parallel_shards(batch, dp)
    assert [s["tokens"][:, 0].tolist() for s in shards] == [[0, 5, 10], [0, 5, 10], [15, 20], [15, 20]]


def test_fewer_sequences_than_replicas_are_refused() -> None:
    with pytest.raises(ValueError, match="3 sequences cannot give each of the 4 data-parallel trainer replicas one:"):
        data_parallel_shards(_batch(3), [(rank, 4) for rank in range(4)])
