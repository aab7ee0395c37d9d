"""Weight buckets between trainer and rollout workers: flat byte buffers of bounded size, versioned.

Several trainer ranks send, each its own part of the weights (one sender per expert-parallel rank:
its experts; sender 0 also every non-expert tensor). The content is opaque here: each sender's
``{name: tensor}`` in wire form (``megatron_quads.controller.rollout_export``), turned back into
what engines load by ``megatron_quads.rollout.wire.decode_wire``.

A sender packs its tensors into buckets of at most ``bucket_bytes`` (a tensor larger than that
travels alone). Each bucket is ONE contiguous uint8 buffer plus a table of (name, dtype, shape,
offset), so a transfer is one copy per bucket whatever the dtypes (Ray's tensor serializer cannot
carry float8; a byte buffer can), and on the GPU one CUDA IPC handle per bucket. Buckets are tagged
with the weight version, whether the content is quantized, their sender and the sender count, and
their index and count within that sender. The receiver checks, before it receives or unpacks any
bucket's data, that every sender sent its complete set, all of one version and kind, and that no
tensor name comes twice; it returns the union of the senders' tensors.

Transports (``Bucket.payload``):
- ``object_store``: the buffer on CPU, carried by Ray's object store (any placement, CPU or GPU).
- ``cuda_ipc``: a CUDA IPC handle of a GPU buffer; the receiver maps it and copies once. Only
  between processes on the same GPU (the colocated placement): an engine sees only its own GPU, so
  with several trainer ranks every sender first broadcasts its buffers to every trainer rank over
  the trainers' own process group (:func:`share_buckets`, NCCL between GPUs), and each rank hands
  its engine handles of its own copies. The rank must keep the buffers alive until every receiver
  has copied them (:meth:`BufferKeeper.release`).
- ``collective``: no payload; each sender broadcasts its buffers, in bucket order, over its own
  :class:`~megatron_quads.controller.sync_group.WeightSyncGroup` (that sender and every receiver;
  gloo on CPU, NCCL on GPUs) while every receiver allocates ``buffer_bytes`` and receives them,
  sender by sender (disaggregated placements). The senders broadcast concurrently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from megatron_quads.controller.sync_group import WeightSyncGroup

Transport = Literal["object_store", "cuda_ipc", "collective"]
_ALIGN = 16  # bytes: every tensor starts at an offset any dtype may view


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives inside a bucket's byte buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Bucket:
    """One bounded piece of one sender's part of a weight version: a byte buffer (or a handle to
    it) and its table; ``index`` of ``count`` within sender ``sender`` of ``senders``."""

    version: int
    sender: int
    senders: int
    index: int
    count: int
    quantized: bool
    specs: list[TensorSpec]
    transport: Transport
    payload: Any = field(repr=False)
    buffer_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (alignment padding excluded)."""
        return sum(s.nbytes for s in self.specs)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[TensorSpec]]:
    """Copy tensors (one device) into one aligned uint8 buffer on that device; returns (buffer, table)."""
    specs, offset = [], 0
    for name, t in tensors.items():
        specs.append(TensorSpec(name, _dtype_name(t.dtype), tuple(t.shape), offset, _nbytes(t)))
        offset += -(-_nbytes(t) // _ALIGN) * _ALIGN
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    buffer = torch.empty(offset, dtype=torch.uint8, device=device)
    for spec, t in zip(specs, tensors.values(), strict=True):
        buffer[spec.offset : spec.offset + spec.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buffer, specs


def unpack(buffer: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Views of each tensor in ``buffer`` (clone them if the buffer is not yours to keep)."""
    out = {}
    for s in specs:
        if s.offset + s.nbytes > buffer.numel():
            raise ValueError(f"weight bucket is truncated: {s.name!r} needs bytes up to {s.offset + s.nbytes}, buffer has {buffer.numel()}")
        dtype = getattr(torch, s.dtype)
        out[s.name] = buffer[s.offset : s.offset + s.nbytes].view(dtype).view(s.shape)
    return out


class BufferKeeper:
    """The sender's bucket buffers, held until the receivers have them (CUDA IPC, collective)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def hold(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` alive (its memory must not be reused while a handle is out)."""
        self._buffers.append(buffer)

    def release(self) -> None:
        """Drop the buffers: call once every receiver has acknowledged its copy."""
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        """Bytes currently held."""
        return sum(b.numel() for b in self._buffers)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The held buffers, in bucket order."""
        return list(self._buffers)



def to_buckets(
    tensors: dict[str, torch.Tensor],
    version: int,
    *,
    quantized: bool,
    sender: int = 0,
    senders: int = 1,
    bucket_bytes: int = 256 * 2**20,
    transport: Transport = "object_store",
    keep_alive: BufferKeeper | None = None,
) -> list[Bucket]:
    """Split one sender's tensors (wire form) into buckets of bounded size, packed for ``transport``.

    ``cuda_ipc`` needs the tensors on a CUDA device and a ``keep_alive`` to hold the buffers;
    ``collective`` a ``keep_alive`` too (the sender broadcasts its buffers afterwards). A sender with
    no tensors still sends one (empty) bucket, so the receiver sees it is complete.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if not 0 <= sender < senders:
        raise ValueError(f"sender index {sender} is outside 0..{senders - 1} (senders={senders})")
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if groups[-1] and size + _nbytes(t) > bucket_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += _nbytes(t)
    buckets = []
    for index, group in enumerate(groups):
        buffer, specs = pack(group)
        if transport == "cuda_ipc":
            payload = _ipc_handle(buffer, keep_alive)
        elif transport == "object_store":
            payload = buffer.cpu()
        elif transport == "collective":
            if keep_alive is None:
                raise ValueError("collective weight transport needs a BufferKeeper to hold the buffers until the broadcast")
            keep_alive.hold(buffer)
            payload = None
        else:
            raise ValueError(f"unknown weight transport {transport!r}: use 'object_store', 'cuda_ipc' or 'collective'")
        buckets.append(Bucket(version, sender, senders, index, len(groups), quantized, specs, transport, payload,
                              buffer.numel()))
    return buckets


def share_buckets(
    own: list[Bucket] | None, held: BufferKeeper | None, transport: Transport,
    device: torch.device | str, group: Any = None,
) -> tuple[list[Bucket], BufferKeeper]:
    """Every sender's buckets on every rank of ``group`` (default: the whole torch.distributed world).

    A sending rank passes its buckets packed for ``collective`` (``own``, no payload) and the keeper
    ``held`` that holds their buffers in bucket order; the other ranks pass None twice. The senders
    broadcast their buffers over ``group``, sender after sender and bucket after bucket, and every
    rank wraps what it holds for ``transport`` (``cuda_ipc``: handles of its own buffers on
    ``device``; ``object_store``: the buffers on CPU). Returns every sender's buckets, in sender
    order, and the keeper of this rank's buffers (release it once its receivers have copied).
    Collective: every rank of ``group`` calls it.
    """
    import torch.distributed as dist

    if transport not in ("cuda_ipc", "object_store"):
        raise ValueError(f"share_buckets wraps the shared buffers for 'cuda_ipc' or 'object_store', not {transport!r}")
    if (own is None) != (held is None) or (own is not None and len(own) != len(held.buffers)):
        raise ValueError("a sending rank passes its collective buckets and the keeper holding their buffers, "
                         "one buffer per bucket; the other ranks pass neither")
    tables: list[list[Bucket] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(tables, None if own is None else [replace(b, payload=None) for b in own], group=group)
    me = dist.get_rank(group)
    senders = sorted((table[0].sender, rank) for rank, table in enumerate(tables) if table)
    keeper, shared = BufferKeeper(), []
    for _, rank in senders:
        source = rank if group is None else dist.get_global_rank(group, rank)
        for index, table in enumerate(tables[rank]):
            if rank == me:
                buffer = held.buffers[index]
            else:
                buffer = torch.empty(table.buffer_bytes, dtype=torch.uint8, device=device)
            if table.buffer_bytes:
                dist.broadcast(buffer, src=source, group=group)
            payload = _ipc_handle(buffer, keeper) if transport == "cuda_ipc" else buffer.cpu()
            if transport != "cuda_ipc":
                keeper.hold(buffer)
            shared.append(replace(table, transport=transport, payload=payload))
    return shared, keeper


def _ipc_handle(buffer: torch.Tensor, keep_alive: BufferKeeper | None) -> tuple:
    if not buffer.is_cuda:
        raise ValueError("cuda_ipc weight transport needs the weights on a CUDA device; use object_store on CPU")
    if keep_alive is None:
        raise ValueError("cuda_ipc weight transport needs a BufferKeeper to hold the sender's buffers")
    from torch.multiprocessing.reductions import reduce_tensor

    keep_alive.hold(buffer)
    return reduce_tensor(buffer)


def _receive(bucket: Bucket, device: torch.device | str | None,
             groups: Sequence[WeightSyncGroup] | None) -> dict[str, torch.Tensor]:
    if bucket.transport == "collective":
        if groups is None or len(groups) != bucket.senders:
            have = 0 if groups is None else len(groups)
            raise ValueError(f"collective weight buckets from {bucket.senders} sender(s) need one WeightSyncGroup per "
                             f"sender; the receiver has {have} (join the senders' groups first)")
        group = groups[bucket.sender]
        buffer = group.broadcast(torch.empty(bucket.buffer_bytes, dtype=torch.uint8, device=group.device))
        if device is not None:
            buffer = buffer.to(device)
    elif bucket.transport == "cuda_ipc":
        rebuild, args = bucket.payload
        shared = rebuild(*args)  # maps the sender's memory: copy out before the sender releases it
        buffer = shared.clone() if device is None else shared.to(device, copy=True)
        del shared
    else:
        buffer = bucket.payload if device is None else bucket.payload.to(device)
    return unpack(buffer, bucket.specs)


def check_buckets(buckets: list[Bucket]) -> list[Bucket]:
    """The buckets in receive order (sender, then index) once the set is whole: every sender
    0..senders-1 with all its buckets, one version, one kind (quantized or not), no tensor twice."""
    if not buckets:
        raise ValueError("received no weight buckets")
    first = buckets[0]
    for what in ("senders", "version", "quantized"):
        values = {getattr(b, what) for b in buckets}
        if len(values) != 1:
            raise ValueError(f"weight buckets disagree on {what}: {sorted(values)}; every bucket of one sync must "
                             "come from the same export")
    by_sender: dict[int, list[Bucket]] = {}
    for b in buckets:
        if not 0 <= b.sender < first.senders:
            raise ValueError(f"weight bucket from sender {b.sender}, outside 0..{first.senders - 1}")
        by_sender.setdefault(b.sender, []).append(b)
    missing = [s for s in range(first.senders) if s not in by_sender]
    if missing:
        raise ValueError(f"incomplete weight sync: no buckets from sender(s) {missing} of {first.senders}; every "
                         "sending trainer rank's buckets must reach every engine")
    ordered = []
    for sender in range(first.senders):
        own = sorted(by_sender[sender], key=lambda b: b.index)
        counts = {b.count for b in own}
        indices = [b.index for b in own]
        if len(counts) != 1:
            raise ValueError(f"weight buckets of sender {sender} disagree on their count: {sorted(counts)}")
        if indices != list(range(own[0].count)):
            raise ValueError(f"incomplete weight sync: sender {sender} sent buckets {indices} of {own[0].count}")
        ordered += own
    seen: dict[str, tuple[int, int]] = {}
    for b in ordered:
        for spec in b.specs:
            if spec.name in seen:
                raise ValueError(f"tensor {spec.name!r} arrived twice: in sender {seen[spec.name][0]}'s bucket "
                                 f"{seen[spec.name][1]} and sender {b.sender}'s bucket {b.index}; each tensor must "
                                 "have exactly one sender")
            seen[spec.name] = (b.sender, b.index)
    return ordered


def from_buckets(
    buckets: list[Bucket], device: torch.device | str | None = None,
    groups: Sequence[WeightSyncGroup] | None = None,
) -> tuple[dict[str, torch.Tensor], bool, int]:
    """Inverse of :func:`to_buckets` over every sender: (the union of their tensors, quantized,
    version), on ``device`` if given; a bad set raises before any bucket is received or unpacked
    (:func:`check_buckets`).

    ``collective`` buckets are received over ``groups[sender]``, sender after sender, each in index
    order (the order that sender broadcasts).
    """
    ordered = check_buckets(buckets)
    tensors: dict[str, torch.Tensor] = {}
    for b in ordered:
        tensors.update(_receive(b, device, groups))
    return tensors, ordered[0].quantized, ordered[0].version


def buckets_bytes(buckets: list[Bucket]) -> int:
    """Bytes of tensor data in a set of buckets."""
    return sum(b.nbytes for b in buckets)
