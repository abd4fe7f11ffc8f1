"""The bucket plan of a weight push: which tensors travel together, in which order, and the buffers that
takes. A pure function of the tensors' names, shapes and dtypes, so the learner and every engine compute the
same layout on their own and only a version number needs to be exchanged; the memory plan
(``memory.py``) sizes the push's buffers from it. The transport that moves the bytes is
``cluster/transport/weights.py``."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

DEFAULT_BUCKET_BYTES = 128 << 20

CHECKSUM_CHUNK_ELEMS = 1 << 22
"""Elements per float64 chunk of ``checksum`` (``cluster/transport/weights.py``): each chunk is converted to float64 on its own, so the
temporary is at most ``CHECKSUM_CHUNK_BYTES`` (32 MiB) whatever the tensor (a whole-tensor ``double()``
of a 7B's embedding, 545M elements, would be 4.4 GB, twice with its ``abs()``)."""
CHECKSUM_CHUNK_BYTES = 8 * CHECKSUM_CHUNK_ELEMS
"""Bytes of the largest float64 temporary ``checksum`` (``cluster/transport/weights.py``) makes (one chunk)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    specs: tuple[TensorSpec, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Group tensors, in order, into single-dtype buckets of at most ``bucket_bytes``.

    The plan is a pure function of the specs, so the learner and every worker compute the same
    layout independently and only the version number needs to be exchanged. A tensor larger than
    the budget gets a bucket of its own.
    """
    buckets: list[Bucket] = []
    cur: list[TensorSpec] = []
    cur_bytes = 0
    cur_dtype: torch.dtype | None = None
    for spec in specs:
        size = spec.numel * torch.empty((), dtype=spec.dtype).element_size()
        if cur and (spec.dtype != cur_dtype or cur_bytes + size > bucket_bytes):
            buckets.append(Bucket(cur_dtype, tuple(cur)))
            cur, cur_bytes = [], 0
        cur.append(spec)
        cur_dtype = spec.dtype
        cur_bytes += size
    if cur:
        buckets.append(Bucket(cur_dtype, tuple(cur)))
    return buckets


def layout_digest(specs: Sequence[TensorSpec]) -> str:
    """A short digest of names/shapes/dtypes: sender and receivers must agree before any bytes move."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}:{s.shape}:{s.dtype};".encode())
    return h.hexdigest()[:16]


def wire_layout(own: Sequence[TensorSpec], sender: Sequence[TensorSpec]) -> list[TensorSpec]:
    """The layout a receiver uses: the sender's (learner's) specs, after checking that they name the
    receiver's parameters in the same order with the same shapes. Dtypes may differ -- a bf16 learner
    sends bf16 to engines that hold float32 (or vLLM's own dtype); the engine casts on load -- so the
    buckets follow the sender's dtypes. Raises ValueError naming the first difference."""
    if len(own) != len(sender):
        raise ValueError(f"weight layout: the learner sends {len(sender)} tensors, this engine has {len(own)} "
                         "(model.* config or model.path must be the same for every role)")
    for i, (a, b) in enumerate(zip(own, sender)):
        if a.name != b.name or tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"weight layout: tensor {i} is {b.name} {tuple(b.shape)} on the learner and "
                             f"{a.name} {tuple(a.shape)} in this engine")
    return [TensorSpec(s.name, tuple(s.shape), s.dtype) for s in sender]


def slot_sizes(buckets: Sequence[Bucket], needs: Sequence[bool] | None = None) -> list[int]:
    """Bytes of the two stream buffers for a plan: bucket i goes through buffer i % 2, so buffer k is as
    large as the largest bucket of parity k that needs one (``needs``; None: every bucket). A 7B's
    embedding and LM head (1.09 GB each, buckets 0 and 114 of 115) share buffer 0; buffer 1 needs only
    the largest other bucket."""
    out = [0, 0]
    for i, b in enumerate(buckets):
        if needs is None or needs[i]:
            out[i % 2] = max(out[i % 2], b.nbytes)
    return out


def recv_buffer_bytes(buckets: Sequence[Bucket]) -> int:
    """Bytes of a streaming receiver's two bucket buffers (``BroadcastGroup.recv_streamed``, ``cluster/transport/weights.py``)."""
    return sum(slot_sizes(buckets))


def send_buffer_bytes(buckets: Sequence[Bucket], in_place: bool = True) -> int:
    """Bytes of the sender's two bucket buffers (``BroadcastGroup.send_weights``, ``cluster/transport/weights.py``). ``in_place``: the
    parameters are contiguous and on the group's device (NCCL from a GPU learner, gloo from a CPU one), so
    a bucket of one tensor is sent from the tensor itself and needs no buffer; False (gloo from a GPU
    learner): every bucket is flattened into host memory."""
    return sum(slot_sizes(buckets, [not (in_place and len(b.specs) == 1) for b in buckets]))
