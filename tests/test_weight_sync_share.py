"""Every sender's weight buckets on every trainer rank (``share_buckets``): 3 spawned gloo ranks.

Under CUDA IPC each colocated engine maps only its own GPU, so the senders broadcast their packed
buckets to every trainer rank first; on CPU the same broadcasts run over gloo and the copies are
wrapped for the object store, so what each rank would hand its engine can be checked byte for byte.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from mp_harness import Recorder, get, spawn

WORLD = 3
CASES = {
    # case: {rank: (sender index, senders, number of tensors)}; ranks not listed send nothing
    "two_senders_one_bystander": {0: (0, 2, 5), 1: (1, 2, 3)},
    "one_sender_data_parallel": {0: (0, 1, 4)},
    "sender_order_is_not_rank_order_and_one_part_is_empty": {2: (0, 2, 6), 0: (1, 2, 0)},
}
BUCKET_BYTES = 150


def sender_tensors(sender: int, count: int) -> dict[str, torch.Tensor]:
    """Sender ``sender``'s tensors: mixed dtypes and shapes, so buckets split and offsets align."""
    gen = torch.Generator().manual_seed(100 + sender)
    out = {}
    for i in range(count):
        shape = (3 + i, 7)
        dtype = (torch.float32, torch.bfloat16, torch.uint8)[i % 3]
        values = torch.randn(shape, generator=gen) * 10
        out[f"sender{sender}.t{i}"] = values.to(dtype) if dtype != torch.uint8 else values.abs().to(torch.uint8)
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _job(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_quads.controller.weight_sync import BufferKeeper, from_buckets, share_buckets, to_buckets

    record = Recorder(out_dir, rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=WORLD, rank=rank)

    def case(name: str) -> None:
        own = held = None
        if rank in CASES[name]:
            sender, senders, count = CASES[name][rank]
            held = BufferKeeper()
            own = to_buckets(sender_tensors(sender, count), 7, quantized=True, sender=sender, senders=senders,
                             bucket_bytes=BUCKET_BYTES, transport="collective", keep_alive=held)
        shared, keeper = share_buckets(own, held, "object_store", "cpu")
        tensors, quantized, version = from_buckets(shared)
        record(name, order=[(b.sender, b.index, b.count) for b in shared],
               transports=sorted({b.transport for b in shared}), quantized=quantized, version=version,
               tensors={n: [digest(t), str(t.dtype), list(t.shape)] for n, t in tensors.items()},
               held=keeper.nbytes, buffer_bytes=sum(b.buffer_bytes for b in shared))

    for name in CASES:
        record.run(name, case, name)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    return spawn(_job, WORLD, tmp_path_factory.mktemp("share_buckets"), timeout_s=120)


@pytest.mark.parametrize("name", CASES)
def test_every_rank_holds_every_senders_tensors_byte_for_byte(job: dict, name: str) -> None:
    expected = {}
    for sender, _, count in CASES[name].values():
        expected.update({n: [digest(t), str(t.dtype), list(t.shape)] for n, t in sender_tensors(sender, count).items()})
    records = get(job, name)
    for r in records:
        assert r["tensors"] == expected
        assert r["quantized"] is True and r["version"] == 7 and r["transports"] == ["object_store"]
        # this rank keeps a copy of every buffer until its engine has it
        assert r["held"] == r["buffer_bytes"]
    assert len({str(r["order"]) for r in records}) == 1


def test_the_buckets_come_in_sender_order_and_split_at_the_bound(job: dict) -> None:
    order = get(job, "two_senders_one_bystander")[0]["order"]
    assert [s for s, _, _ in order] == sorted(s for s, _, _ in order)
    assert max(c for _, _, c in order) > 1  # the bucket bound split a sender's part
    reordered = get(job, "sender_order_is_not_rank_order_and_one_part_is_empty")[0]["order"]
    assert reordered[0][0] == 0 and reordered[-1] == [1, 0, 1]  # sender 1 (on rank 0) sent one empty bucket


def test_a_sender_without_its_buffers_is_refused_before_any_collective() -> None:
    from megatron_quads.controller.weight_sync import BufferKeeper, share_buckets, to_buckets

    held = BufferKeeper()
    own = to_buckets(sender_tensors(0, 2), 1, quantized=False, transport="collective", keep_alive=held)
    with pytest.raises(ValueError, match="keeper holding their buffers"):
        share_buckets(own, None, "cuda_ipc", "cpu")
    with pytest.raises(ValueError, match="not 'collective'"):
        share_buckets(own, held, "collective", "cpu")
