"""Weight buckets between trainer and rollout workers: flat byte buffers of bounded size, versioned.

The sender packs weights (NVFP4-plus-residual tensors, or BF16 ones by HF name) into buckets of at
most ``bucket_bytes`` (a tensor larger than that travels alone). Each bucket is ONE contiguous uint8
buffer plus a table of (name, dtype, shape, offset), so a transfer is one copy per bucket whatever
the dtypes (Ray's tensor serializer cannot carry float8; a byte buffer can), and on the GPU one CUDA
IPC handle per bucket. Buckets are tagged with the weight version, their index and the bucket count;
the receiver checks the set is complete and from one version, then rebuilds the weights, which
validates every tensor's name, shape and dtype (``QuantizedModelWeights.from_state_dict``).

Transports (``Bucket.payload``):
- ``object_store``: the buffer on CPU, carried by Ray's object store (any placement, CPU or GPU).
- ``cuda_ipc``: a CUDA IPC handle of the sender's GPU buffer; the receiver maps it and copies once.
  Only between processes on the same GPU (the colocated placement). The sender must keep the
  buffer alive until every receiver has copied it (:meth:`IpcKeepAlive.release`).
- ``collective``: no payload; the sender broadcasts the buffers, in bucket order, over a
  :class:`~megatron_quads.controller.sync_group.WeightSyncGroup` (gloo on CPU, NCCL on GPUs) while
  every receiver allocates ``buffer_bytes`` and receives them (disaggregated placements).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megatron_quads.rollout.weights import QuantizedModelWeights

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
    """One bounded piece of a weight version: a byte buffer (or a handle to it) and its table."""

    version: int
    index: int
    count: int
    quantized: bool
    config: dict[str, Any] | None
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
    weights: QuantizedModelWeights | dict[str, torch.Tensor],
    version: int,
    bucket_bytes: int = 256 * 2**20,
    transport: Transport = "object_store",
    keep_alive: BufferKeeper | None = None,
) -> list[Bucket]:
    """Split weights into buckets of bounded size, packed for ``transport``.

    ``cuda_ipc`` needs the weights on a CUDA device and a ``keep_alive`` to hold the buffers;
    ``collective`` a ``keep_alive`` too (the sender broadcasts its buffers afterwards).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    quantized = isinstance(weights, QuantizedModelWeights)
    tensors = weights.state_dict() if quantized else dict(weights)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if groups[-1] and size + _nbytes(t) > bucket_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += _nbytes(t)
    config = dict(weights.config) if quantized else None
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
        buckets.append(Bucket(version, index, len(groups), quantized, config, specs, transport, payload, buffer.numel()))
    return buckets


def _ipc_handle(buffer: torch.Tensor, keep_alive: BufferKeeper | None) -> tuple:
    if not buffer.is_cuda:
        raise ValueError("cuda_ipc weight transport needs the weights on a CUDA device; use object_store on CPU")
    if keep_alive is None:
        raise ValueError("cuda_ipc weight transport needs an IpcKeepAlive to hold the sender's buffers")
    from torch.multiprocessing.reductions import reduce_tensor

    keep_alive.hold(buffer)
    return reduce_tensor(buffer)


def _receive(bucket: Bucket, device: torch.device | str | None, group=None) -> dict[str, torch.Tensor]:
    if bucket.transport == "collective":
        if group is None:
            raise ValueError("collective weight buckets need the receiver's WeightSyncGroup")
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


def from_buckets(
    buckets: list[Bucket], device: torch.device | str | None = None, group=None
) -> tuple[QuantizedModelWeights | dict[str, torch.Tensor], int]:
    """Inverse of :func:`to_buckets`: (weights, version), on ``device`` if given; a bad set raises.

    ``collective`` buckets are received over ``group`` in index order (the order the sender broadcasts).
    """
    if not buckets:
        raise ValueError("received no weight buckets")
    first = buckets[0]
    indices = sorted(b.index for b in buckets)
    if indices != list(range(first.count)) or any(b.count != first.count for b in buckets):
        raise ValueError(f"incomplete weight sync: got buckets {indices} of {first.count}")
    versions = {b.version for b in buckets}
    if len(versions) != 1:
        raise ValueError(f"weight buckets from different versions {sorted(versions)}")
    tensors: dict[str, torch.Tensor] = {}
    for b in sorted(buckets, key=lambda b: b.index):
        for name, t in _receive(b, device, group).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} arrived in two buckets")
            tensors[name] = t
    if first.quantized:
        return QuantizedModelWeights.from_state_dict(tensors, first.config), first.version
    return tensors, first.version


def buckets_bytes(buckets: list[Bucket]) -> int:
    """Bytes of tensor data in a set of buckets."""
    return sum(b.nbytes for b in buckets)
