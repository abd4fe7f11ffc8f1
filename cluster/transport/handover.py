"""The colocated hand-over: the weight push between processes that share one device.

In colocated placement (``cluster.placement=colocated``) a learner rank and a rollout engine live on
the same device and take turns. NCCL refuses two ranks of one GPU, and a broadcast would copy the
weights through a transport the two processes do not need: they can both map the same memory. The
hand-over is therefore a *collective backend* of its own, :class:`HandoverCollective`, with the two
calls ``BroadcastGroup`` makes of a process group (``broadcast(tensor, root)`` and ``allreduce([t])``,
each returning a work with ``wait(timeout)``). ``BroadcastGroup(..., backend="shm" | "cuda_ipc")``
builds it over the formation's store, so the push keeps everything it has: the bucket plan, the
handshake, streamed receives into vLLM's workers, checksums, the presence barrier and its abort.

How one broadcast moves (``seq`` counts the group's collectives; every rank calls them in one order):

    root      wait until every receiver took the last broadcast (the segment is reused)
              copy the tensor into the segment                 (one copy: device memory or /dev/shm)
              store: "b<seq>" = where the segment is and how many bytes
    receiver  store.wait("b<seq>")                             (an event, bounded by the group's timeout)
              copy the segment into its tensor                 (map the segment first if it is new)
              store: "a<seq>/<rank>"                           (the root may now reuse the segment)

The segment: on CPU (``shm``) a file in ``/dev/shm`` (the temporary folder where there is none), mapped
by every rank; on GPU (``cuda_ipc``) a device buffer of the root, opened by the receivers through its
CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``: OpenRLHF's and veRL's route; the
two processes see the GPU under the same index because they share one Ray bundle of one GPU). It is
as large as the largest tensor broadcast so far (a bucket, ``weights.plan_buckets``), grown by a new
segment when a larger one comes; the root unlinks a file segment once every receiver has mapped it, so
nothing is left in ``/dev/shm`` when a process dies later. Memory beside the model: one bucket on the
root's side, and the receivers' own buffers as in a broadcast.

A receiver whose root died, or a root whose receiver died, raises at ``wait`` within the group's
timeout (``store.wait``), as a broadcast group's peers do. ``allreduce`` sums small integer tensors
through the store (the handshake's one mismatch count).

Pure torch: no Ray, no other Sonar module.
"""
from __future__ import annotations

import datetime
import mmap
import os
import pickle
import tempfile
from typing import Callable

import torch
import torch.distributed as dist


def segment_dir() -> str:
    """Where file segments live: ``/dev/shm`` (memory, not disk) when writable, else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class _Work:
    """A work whose ``wait(timeout)`` runs ``fn(timeout)`` once (later waits return at once)."""

    def __init__(self, fn: Callable[[datetime.timedelta | None], None]):
        self._fn = fn

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn(timeout)
        return True


class _FileSegment:
    """A file in :func:`segment_dir` mapped read-write: ``tensor`` is its bytes (uint8)."""

    def __init__(self, path: str, nbytes: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"weight hand-over: segment {path} is not on this machine (cluster.placement=colocated needs each "
                "engine on its learner rank's node; the root may also have unlinked it after a failed push)") from None
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path, self.nbytes = path, nbytes
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        self.tensor = None
        try:
            self._map.close()
        except BufferError:  # a view still holds it: the mapping goes when that view does
            pass


class HandoverCollective:
    """``broadcast`` and ``allreduce`` between processes that share a device (module docstring).

    ``store``: the formation's ``PrefixStore``; ``name``: unique on the machine while the group lives (the
    file segments' name base; ``BroadcastGroup`` uses its store's port and prefix); ``device``: cpu (file
    segments) or a CUDA device (IPC)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, name: str, device: torch.device | str = "cpu"):
        self._store, self.rank, self.world_size = store, rank, world_size
        self.name, self.device = name, torch.device(device)
        self._seq = 0
        self._acked = -1  # root: the last broadcast every receiver took
        self._last: int | None = None  # root: the last broadcast written (an allreduce takes a seq too)
        self._segment = None  # root: (key, tensor[uint8], file segment or None); receiver: the mapped one
        self._unlink_after: int | None = None  # root: unlink the file segment once this broadcast is taken
        self._made = 0

    # ------------------------------------------------------------ the segment
    def _root_segment(self, nbytes: int, seq: int) -> torch.Tensor:
        if self._segment is not None and self._segment[1].numel() >= nbytes:
            return self._segment[1]
        self._drop_segment()
        self._made += 1
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA (bench/gpu_check.py runs it)
            from torch.multiprocessing.reductions import reduce_tensor

            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            rebuild, args = reduce_tensor(buf)
            key = f"ipc{self._made}"
            self._store.set(key, pickle.dumps((rebuild, args)))
            self._segment = (key, buf, None)
        else:
            # the root's pid: a file left by a crashed process (killed between create and the first take)
            # can never collide with a later group that reuses its store's port and prefix
            path = os.path.join(segment_dir(), f"{self.name}-{os.getpid()}-{self._made}")
            seg = _FileSegment(path, nbytes, create=True)
            self._segment = (path, seg.tensor, seg)
            self._unlink_after = seq  # once this broadcast is taken, every receiver has it mapped
        return self._segment[1]

    def _peer_segment(self, where: str) -> torch.Tensor:
        if self._segment is not None and self._segment[0] == where:
            return self._segment[1]
        self._drop_segment()
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA
            rebuild, args = pickle.loads(self._store.get(where))
            self._segment = (where, rebuild(*args), None)
        else:
            seg = _FileSegment(where, os.path.getsize(where), create=False)
            self._segment = (where, seg.tensor, seg)
        return self._segment[1]

    def _drop_segment(self) -> None:
        """Unmap the current segment (a root grows only after its last broadcast was taken, so its file is
        unlinked already: ``_taken``)."""
        if self._segment is not None:
            _, _, seg = self._segment
            self._segment = None
            if seg is not None:
                seg.close()

    # ------------------------------------------------------------ collectives
    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        if not t.is_contiguous():
            raise ValueError("weight hand-over: broadcast of a non-contiguous tensor")
        return t.reshape(-1).view(torch.uint8)

    def _sync(self) -> None:
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA
            torch.cuda.synchronize(self.device)

    def _await(self, keys: list[str], timeout: datetime.timedelta | None, what: str) -> None:
        try:
            if timeout is None:
                self._store.wait(keys)
            else:
                self._store.wait(keys, timeout)
        except Exception as e:  # DistStoreError / RuntimeError: a peer that never came
            raise TimeoutError(f"weight hand-over: rank {self.rank} of {self.world_size} waited for {what} "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                               "cluster.broadcast_timeout_s bounds it") from None

    def _taken(self, seq: int, timeout) -> None:
        """Root: wait until every receiver has taken broadcast ``seq``, then forget its keys."""
        if seq <= self._acked:
            return
        peers = [r for r in range(self.world_size) if r != self.rank]
        self._await([f"a{seq}/{r}" for r in peers], timeout, f"every receiver to take broadcast {seq}")
        self._acked = seq
        for k in [f"b{seq}", *(f"a{seq}/{r}" for r in peers)]:
            self._store.delete_key(k)
        if self._unlink_after is not None and seq >= self._unlink_after and self._segment is not None:
            path, _, seg = self._segment
            if seg is not None:
                os.unlink(path)  # every receiver holds its mapping: the memory stays until the last unmaps
            self._unlink_after = None

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> _Work:
        seq = self._seq
        self._seq += 1
        if root != 0:
            raise ValueError(f"weight hand-over: root {root}; the learner (rank 0) is the only source")
        data = self._bytes(tensor)
        if self.rank == root:
            if self._last is not None:
                self._taken(self._last, None)  # the segment is about to be rewritten
            self._last = seq
            seg = self._root_segment(data.numel(), seq)
            seg[:data.numel()].copy_(data)
            self._sync()
            self._store.set(f"b{seq}", f"{self._segment[0]}|{data.numel()}".encode())
            return _Work(lambda timeout: self._taken(seq, timeout))

        def receive(timeout) -> None:
            self._await([f"b{seq}"], timeout, f"the learner's broadcast {seq}")
            where, n = self._store.get(f"b{seq}").decode().rsplit("|", 1)
            if int(n) != data.numel():
                raise RuntimeError(f"weight hand-over: broadcast {seq} carries {n} bytes, rank {self.rank} expects "
                                   f"{data.numel()}")
            data.copy_(self._peer_segment(where)[:data.numel()])
            self._sync()
            self._store.set(f"a{seq}/{self.rank}", b"1")

        return _Work(receive)

    def allreduce(self, tensors: list[torch.Tensor]) -> _Work:
        """Sum of small integer tensors over the ranks, through the store (the handshake's mismatch count)."""
        seq = self._seq
        self._seq += 1
        (t,) = tensors
        if t.dtype.is_floating_point:
            raise ValueError(f"weight hand-over: allreduce of {t.dtype}; integers only")
        for j, v in enumerate(t.reshape(-1).tolist()):
            self._store.add(f"r{seq}/{j}", int(v))
        self._store.set(f"r{seq}/in/{self.rank}", b"1")

        def total(timeout) -> None:
            self._await([f"r{seq}/in/{r}" for r in range(self.world_size)], timeout, f"every rank at allreduce {seq}")
            sums = [self._store.add(f"r{seq}/{j}", 0) for j in range(t.numel())]
            t.copy_(torch.tensor(sums, dtype=t.dtype).reshape(t.shape))

        return _Work(total)

    def close(self) -> None:
        """Drop the segment (a root's file is unlinked if no receiver has taken it yet)."""
        if self._segment is not None and self.rank == 0 and self._unlink_after is not None:
            path, _, seg = self._segment
            if seg is not None:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            self._unlink_after = None
        if self._segment is not None:
            _, _, seg = self._segment
            self._segment = None
            if seg is not None:
                seg.close()
