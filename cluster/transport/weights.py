"""The weight-broadcast group and the bucketed weight push.

One torch.distributed process group spans the learner (rank 0, the source) and every rollout worker
(ranks 1..N). It is *stateless*: built directly on a TCPStore + PrefixStore instead of the global
default group, so it coexists with DeepSpeed's own group inside the learner process and can be
rebuilt (new prefix) when a worker is restarted. NCCL on GPU, gloo on CPU.

Tensors travel in flat buckets of ``bucket_bytes`` (one dtype per bucket): one collective per bucket
instead of one per parameter, which is what makes the push cheap. Only a small "version v ready"
message travels through Ray. Every rank must build its ``BroadcastGroup`` concurrently: group creation
blocks until all ranks have joined.

Memory: the push is *streamed* on both sides, two bucket buffers each, never a copy of the model.
The sender flattens bucket i+1 into one buffer while bucket i's broadcast is in flight from the other
(a bucket of one tensor already in place is sent from the tensor itself); a receiver that loads as it
goes (:meth:`BroadcastGroup.recv_streamed`, the vLLM workers) receives bucket i+1 while it loads bucket
i. Peaks, from the bucket plan (:func:`send_buffer_bytes`, :func:`recv_buffer_bytes`): 2 x the largest
bucket that needs flattening on the learner, 2 x the largest bucket on a receiver (the largest bucket is
``bucket_bytes`` or the largest tensor, e.g. a 7B's 1.09 GB embedding), less where the largest buckets
share a parity (bucket i goes through buffer i % 2, each sized for its own buckets), plus what the
receiver's loader keeps past its bucket (see ``recv_streamed``). Only the HF engines' receivers
(``RolloutWorker.receive_weights``) stage a full copy, by design: they swap it in between generate calls.

Every push starts with a handshake (the sender's bucket plan, checked by every receiver, then one
all-reduce of the mismatches) so a receiver with another plan fails every rank before bytes move, and
the sender's timing starts once every receiver is there: ``last_push["seconds"]`` is the transfer,
measured to the completion of the last collective (``torch.cuda.synchronize`` on CUDA),
``last_push["wait_s"]`` the wait for the receivers.

Timeouts: every wait is ``work.wait(timeout)``, so a dead peer raises at the call within the group's
``timeout_s`` (gloo: ``RuntimeError: Operation timed out!``). NCCL: a wait with an explicit timeout
blocks the calling thread until the work completes or times out; on timeout torch aborts the
communicator and raises ``DistBackendError`` there. The NCCL watchdog thread also checks every work
against the group's option timeout, ``timeout_s + NCCL_WATCHDOG_MARGIN_S``, so the Python error comes
first; torch's default (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) would take the whole process down when one
expires, so this group is built with 2 (abort the communicator only, ``nccl_backend``). After either,
the group is dead: rebuild it.

Checksums (:func:`checksum`, :class:`Checksum`) sum each tensor in float64 chunks of
``CHECKSUM_CHUNK_ELEMS`` elements: no full-tensor float64 copy, and a receiver sums each bucket as it
arrives, so it keeps nothing to checksum later.

A push is abortable too. A receiver that dies mid-push breaks its own sockets, so its direct peers fail
at once, but a rank downstream of it in the backend's broadcast tree waits for bytes from a live peer
that has given up: the whole ``timeout_s``. So every wait of a push (``BroadcastGroup._wait``) looks at
the same call-off key as the presence barrier every ``PUSH_CALL_OFF_POLL_S`` while its collective is
unfinished, and raises ``GroupAborted`` once the driver, which sees the death, has set it; a rank that
cannot reach rank 0's store any more (the learner died) raises too. gloo: the wait sleeps on the work's
future and wakes the moment it completes. NCCL: its future completes at enqueue, so the wait polls
``work.is_completed()`` (a CUDA event query) with sleeps growing 25 % from 50 us up to 20 ms (a push
waits at most a quarter longer than its collective). A called-off rank aborts its group
(``BroadcastGroup.abort``: ``ncclCommAbort`` on NCCL, so the kernel of a collective whose peer died
returns; nothing on gloo, whose stranded work ends at the group's timeout in a thread nobody waits on)
and the driver forms a new one. What NCCL still decides: when a peer's death is noticed inside the
library (a socket error, its own timeout), and the process's fate on a watchdog error; the group is
built with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (``nccl_backend``): the watchdog aborts the
communicator and the wait raises, the learner's process lives. Other backends (shm, cuda_ipc: one node,
no peer to die mid-copy) wait as before.

Formation is abortable until every rank is there: each rank first marks itself present on the store and
waits for the others (:func:`presence_barrier`), and only then enters the backend's own rendezvous
(gloo's full mesh, NCCL's unique-id exchange), which nothing can interrupt. A rank that dies before it
arrives would otherwise leave every other rank waiting the whole ``timeout_s`` (the driver's
``cluster.broadcast_timeout_s``, by default ``step_timeout_s``: minutes of every GPU idle); the driver,
which sees the death, calls the formation off (:func:`abort_formation`) and the waiting ranks raise
``GroupAborted`` at once. A rank that never comes is named when the wait times out.

Sockets stay on the address they were given: rank 0's store listens on ``master_addr`` only (torch's
own master TCPStore would listen on every interface) and each rank's gloo pair sockets on the local
address that reaches ``master_addr`` (127.0.0.1 for a local run); see :func:`master_store`.
"""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import socket
import threading
import time
import weakref
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from sonar.cluster.wire.buckets import (CHECKSUM_CHUNK_BYTES, CHECKSUM_CHUNK_ELEMS, DEFAULT_BUCKET_BYTES,  # noqa: F401
                                        Bucket, TensorSpec, layout_digest, plan_buckets, recv_buffer_bytes,
                                        send_buffer_bytes, slot_sizes, wire_layout)

NCCL_WATCHDOG_MARGIN_S = 60.0
"""Seconds the NCCL option timeout (the watchdog's, which aborts the process) exceeds the group's
``timeout_s`` (the waits', which raise at the call): the Python error must come first."""


PRESENCE_SUFFIX = "-presence"
"""The presence barrier's keys live under ``<prefix>-presence/`` (``present/<rank>``, ``abort``), apart from
the backend's own keys under ``<prefix>/``."""
PRESENCE_POLL_S = 0.02
"""Seconds between two looks at the store while ranks are missing (a key check is one loopback or LAN
round trip; ``store.wait`` with short timeouts would log a c10d warning per slice)."""


PUSH_CALL_OFF_POLL_S = 0.25
"""Seconds between two looks at the call-off key while a push's collective is unfinished: how long a rank
stays in a push the driver called off (each look is one round trip to rank 0's store, so 1,000 ranks
waiting make 4,000 small requests a second there; a push that completes never looks)."""


class GroupAborted(RuntimeError):
    """The driver called this group off (:func:`abort_formation`): a rank died before every rank arrived,
    or during a push (the others stop waiting for bytes that will not come)."""


class _CalledOff:
    """What a called-off ``BroadcastGroup`` holds in place of its backend group: any collective on it
    raises ``GroupAborted`` (the driver forms a new group; this one is never used again)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def _refuse(self, *args, **kwargs):
        raise GroupAborted(f"weight group at rank {self.rank} of {self.world_size} was called off: "
                           "a new group must be formed")

    broadcast = allreduce = _refuse


def presence_barrier(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Mark ``rank`` present on ``store`` (a formation's own ``PrefixStore``) and return once all
    ``world_size`` ranks are. Raises ``GroupAborted`` as soon as the formation is called off, and
    ``TimeoutError`` naming the ranks that never arrived after ``timeout_s`` seconds."""
    store.set(f"present/{rank}", b"1")
    keys = [f"present/{r}" for r in range(world_size)]
    end = time.monotonic() + timeout_s
    while True:
        # abort first: a formation called off is abandoned by every rank that looks, even if complete
        if store.check(["abort"]):
            raise GroupAborted(f"weight-broadcast group formation called off at rank {rank} of {world_size}: "
                               f"{store.get('abort').decode(errors='replace')}")
        if store.check(keys):
            return
        if time.monotonic() >= end:
            missing = [r for r in range(world_size) if not store.check([f"present/{r}"])]
            raise TimeoutError(f"weight-broadcast group: rank(s) {missing} of {world_size} did not arrive within "
                               f"{timeout_s:g} s (rank {rank} waited; cluster.broadcast_timeout_s)")
        time.sleep(PRESENCE_POLL_S)


def _completion(work, backend: str) -> Callable[[float], bool]:
    """``finished(seconds) -> bool``: waits up to ``seconds`` for ``work`` without consuming or aborting it
    (a timed ``work.wait`` on NCCL aborts the communicator). gloo: sleeps on its future. NCCL: polls
    ``is_completed`` with growing sleeps (module docstring)."""
    if backend == "gloo":
        done = threading.Event()
        work.get_future().add_done_callback(lambda _f: done.set())  # errors complete the future too
        return done.wait
    pause = [5e-5]

    def finished(seconds: float) -> bool:  # pragma: no cover - needs CUDA
        end = time.monotonic() + seconds
        while not work.is_completed():
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause[0], left))
            pause[0] = min(0.02, pause[0] * 1.25)
        return True
    return finished


def abort_formation(host: str, port: int, prefix: str, reason: str, connect_timeout_s: float = 5.0) -> bool:
    """Call off the formation meeting at rank 0's store ``host:port`` under ``prefix``, or the group it formed:
    every rank still in its :func:`presence_barrier`, or waiting in a push (``BroadcastGroup._wait``),
    raises ``GroupAborted`` carrying ``reason``, and the group is never used again. The driver's side, no
    actor call (rank 0's actor is busy in the barrier or the push). False if the store is gone (every rank
    left already)."""
    try:
        client = dist.TCPStore(host, int(port), None, is_master=False,
                               timeout=datetime.timedelta(seconds=connect_timeout_s))
        dist.PrefixStore(prefix + PRESENCE_SUFFIX, client).set("abort", reason.encode())
        return True
    except (RuntimeError, OSError):  # DistStoreError/DistNetworkError: nobody listens there any more
        return False


def flatten_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors, in spec order, into the flat buffer ``out`` ([bucket.numel]) and return
    it; :func:`unflatten_bucket` is the inverse. ``out`` is reused across syncs by the sender. Each
    tensor is copied through a view of ``out`` in its own shape, so a non-contiguous one (or one on
    another device) costs no temporary."""
    off = 0
    for spec in bucket.specs:
        out[off:off + spec.numel].view(spec.shape).copy_(tensors[spec.name].detach())
        off += spec.numel
    return out


def unflatten_bucket(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views into ``flat`` (no copies): the caller copies them into the model."""
    off = 0
    for spec in bucket.specs:
        yield spec.name, flat[off:off + spec.numel].view(spec.shape)
        off += spec.numel


def name_weight(name: str) -> int:
    """The checksum's weight of a tensor name, 1..997: tensors swapped between names change the sum."""
    return (int(hashlib.md5(name.encode()).hexdigest()[:6], 16) % 997) + 1


def abs_sum(t: torch.Tensor) -> torch.Tensor:
    """``sum |t|`` in float64, a 0-d tensor on ``t``'s device (no host sync), converted to float64
    ``CHECKSUM_CHUNK_ELEMS`` elements at a time: the float64 temporary is one chunk, never the tensor.
    A tensor of at most one chunk gives exactly ``t.double().abs().sum()``; a larger one differs from it
    only by float64 rounding of the chunks' partial sums (relative ~1e-16 per chunk)."""
    t = t.detach()
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    n = t.numel()
    if n == 0:
        return total
    if t.is_contiguous():
        flat = t.view(-1)
        for start in range(0, n, CHECKSUM_CHUNK_ELEMS):
            total += flat[start:start + CHECKSUM_CHUNK_ELEMS].to(torch.float64).abs_().sum()
        return total
    # Non-contiguous: blocks of whole rows along dim 0 (a row larger than a chunk is split further).
    row = n // t.shape[0]
    if row > CHECKSUM_CHUNK_ELEMS:
        for i in range(t.shape[0]):
            total += abs_sum(t[i])
        return total
    step = max(1, CHECKSUM_CHUNK_ELEMS // row)
    for i in range(0, t.shape[0], step):
        total += t[i:i + step].to(torch.float64).abs_().sum()
    return total


class Checksum:
    """The running :func:`checksum` of tensors added one at a time (a receiver adds each tensor as its
    bucket arrives). ``value``: ``sum over tensors of name_weight(name) * sum |t|``, accumulated in
    float64 in the order added; one host sync, when read."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, torch.Tensor]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        self._parts.append((name_weight(name), abs_sum(t)))

    def __len__(self) -> int:
        return len(self._parts)

    @property
    def value(self) -> float:
        if not self._parts:
            return 0.0
        device = self._parts[0][1].device  # one device-to-host copy for all the tensors' sums
        sums = torch.stack([s.to(device) for _, s in self._parts]).cpu().tolist()
        total = 0.0
        for (w, _), s in zip(self._parts, sums):
            total += w * s
        return total


def _add_all(sums: Checksum, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    for name, t in named:
        sums.add(name, t)


def checksum(named: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Order-independent float64 checksum: equal on every rank that holds the same weights.

    ``sum over tensors of name_weight(name) * sum |t|`` in float64, each tensor summed in chunks
    (:func:`abs_sum`): the learner and every receiver use this one function, so equal weights in the same
    order give the same number; in another order the float64 rounding of the total may differ (compare
    with a relative tolerance, 1e-12 is ample)."""
    c = Checksum()
    for name, t in named:
        c.add(name, t)
    return c.value


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) resolves to a loopback address only."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def local_address_towards(host: str) -> str:
    """The address of this machine's interface that reaches ``host`` (the route's source address;
    no packet is sent): 127.0.0.1 for a loopback ``host``, the node's own address otherwise. A rank's
    gloo pair sockets listen there and nowhere else."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def resolve_bind_host(setting: str, node_ip: str, num_nodes: int) -> str:
    """The address the learner's broadcast rendezvous listens on and the workers dial
    (``cluster.bind_host``): loopback -> 127.0.0.1; auto -> 127.0.0.1 on a one-node Ray cluster, else
    ``node_ip`` (the learner's node address as Ray knows it); anything else is an address of that node."""
    if setting == "loopback" or (setting == "auto" and num_nodes <= 1):
        return "127.0.0.1"
    return node_ip if setting == "auto" else setting


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
                return name
    except ImportError:  # pragma: no cover - psutil ships with Ray
        pass
    return "lo"


def master_store(host: str, port: int, world_size: int, timeout_s: float = 300.0,
                 wait_for_workers: bool = False) -> dist.TCPStore:
    """Rank 0's TCPStore, listening on ``host`` only (``port`` 0: a port the OS picks, ``.port``).

    ``TCPStore(host, port, is_master=True)`` binds its server on every interface whatever ``host``
    says (torch 2.13: ``*:port``, IPv6 any); here Sonar binds the listening socket itself on ``host``
    and hands it over (``master_listen_fd``; the store owns and closes it)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(max(128, world_size))
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, bound, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=wait_for_workers, master_listen_fd=sock.detach())


def gloo_options(master_addr: str, timeout: datetime.timedelta) -> "dist.ProcessGroupGloo._Options":
    """Gloo options whose one device listens on the local address that reaches ``master_addr`` (the
    default device resolves the hostname, which may be any interface)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_addr))]
    return opts


def open_store(host: str, world_size: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening now on ``host`` only, on a port the OS picks (``.port``),
    and held until the group closes: no window in which another process can take a port chosen for
    it. ``host``: the address the other ranks dial (the learner's node address; 127.0.0.1 locally)."""
    return master_store(host, 0, world_size, timeout_s)


NCCL_ERROR_HANDLING = "2"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING`` while the weight group is built (each ``ProcessGroupNCCL`` reads it in
its constructor): 2, abort the communicator and raise, never take the process down (torch's default 3
kills it, and with it the learner, when a rank of this group dies). DeepSpeed's own groups keep the
process's setting."""
_ENV_LOCK = threading.Lock()


def nccl_backend(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> "dist.ProcessGroupNCCL":
    """``ProcessGroupNCCL(store, rank, size, options)`` whose option timeout (the watchdog's) is
    ``timeout_s + NCCL_WATCHDOG_MARGIN_S`` (the group's waits pass ``timeout_s`` themselves) and whose
    watchdog aborts only the communicator on an error (``NCCL_ERROR_HANDLING``)."""
    import os

    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = datetime.timedelta(seconds=timeout_s + NCCL_WATCHDOG_MARGIN_S)
    with _ENV_LOCK:  # the variable is the process's: set only around this constructor, then put back
        old = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ERROR_HANDLING
        try:
            return dist.ProcessGroupNCCL(store, rank, world_size, opts)
        finally:
            if old is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = old


def _alias_storage(raw: torch.Tensor):
    """A second, non-owning storage over ``raw``'s memory (None on the meta device or where torch lacks
    the private constructors). The backend gets its flat tensors on it, the consumer its tensors on
    ``raw``'s own storage, so that storage's use count counts the consumer's references and never the
    backend's: a gloo worker thread drops its reference to a finished broadcast's tensor a moment after
    ``wait`` returns (it never touches the memory again, so an alias outliving ``raw`` is harmless)."""
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None or not hasattr(torch._C, "_storage_Use_Count") or raw.device.type == "meta":
        return None  # pragma: no cover - older torch; meta: a dry run with nothing to protect
    return make(raw.data_ptr(), raw.device, raw.numel())


def _use_count(storage) -> int:
    return int(torch._C._storage_Use_Count(storage._cdata))


class BroadcastGroup:
    """A stateless process group for the weight push. Rank 0 is the learner.

    ``store``: rank 0 may pass the store :func:`open_store` bound (then ``master_port`` is its port);
    otherwise rank 0 binds ``master_port`` itself and every other rank dials it. ``timeout_s``: the
    rendezvous, and every wait of a push (a dead peer raises within it; module docstring).

    Every tensor handed to the backend lives on ``self.device`` (CUDA for NCCL, whose groups have no CPU
    backend): the bucket buffers, the handshake and flag tensors; a parameter is sent in place only when
    it already lives there. :meth:`over` builds a group over any backend object and device (tests; on
    the meta device a push is a dry run that moves and checks no bytes)."""

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
                 prefix: str = "sonar-weights", timeout_s: float = 300.0, store: dist.TCPStore | None = None):
        if backend not in ("gloo", "nccl", "shm", "cuda_ipc"):
            raise ValueError(f"broadcast backend={backend!r} is not 'gloo', 'nccl', 'shm' or 'cuda_ipc'")
        if store is not None and (rank != 0 or store.port != master_port):
            raise ValueError(f"BroadcastGroup: a bound store (port {store.port}) is rank 0's, for master_port "
                             f"{master_port}; got rank {rank}")
        if not timeout_s > 0:
            raise ValueError(f"BroadcastGroup: timeout_s={timeout_s!r} must be > 0 (seconds)")
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is not None:
            self._store = store
        elif rank == 0:
            # not wait_for_workers: the presence barrier below waits for the ranks, and can be called off
            self._store = master_store(master_addr, master_port, world_size, timeout_s)
        else:
            self._store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
        # every rank here (or the formation called off) before the backend's uninterruptible rendezvous
        calls = dist.PrefixStore(prefix + PRESENCE_SUFFIX, self._store)
        presence_barrier(calls, rank, world_size, timeout_s)
        pstore = dist.PrefixStore(prefix, self._store)
        if backend in ("shm", "cuda_ipc"):  # colocated: every rank maps one segment (cluster/transport/handover.py)
            from sonar.cluster.transport.handover import HandoverCollective

            device = torch.device("cpu") if backend == "shm" else torch.device("cuda", torch.cuda.current_device())
            pg = HandoverCollective(pstore, rank, world_size, f"sonar-{master_port}-{prefix}", device)
        elif backend == "gloo":  # pair sockets on the interface that reaches master_addr, nowhere else
            pg = dist.ProcessGroupGloo(pstore, rank, world_size, gloo_options(master_addr, timeout))
            device = torch.device("cpu")
        else:  # pragma: no cover - needs CUDA
            pg = nccl_backend(pstore, rank, world_size, timeout_s)
            device = torch.device("cuda", torch.cuda.current_device())
        self._setup(pg, rank, world_size, backend, device, timeout_s)
        if backend in ("gloo", "nccl"):
            self._calls = calls  # where the driver calls a push off (module docstring)

    @classmethod
    def over(cls, pg, rank: int, world_size: int, device: torch.device | str, timeout_s: float = 300.0,
             backend: str = "custom") -> "BroadcastGroup":
        """A group over an existing backend object ``pg`` (``broadcast(tensor, root)`` and
        ``allreduce([tensor])`` returning works with ``wait(timeout)``) whose tensors live on ``device``."""
        self = cls.__new__(cls)
        self._store = None
        self._setup(pg, rank, world_size, backend, torch.device(device), timeout_s)
        return self

    def _setup(self, pg, rank: int, world_size: int, backend: str, device: torch.device, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"BroadcastGroup: timeout_s={timeout_s!r} must be > 0 (seconds)")
        self._pg = pg
        self._calls: dist.Store | None = None
        """The formation's presence store, whose ``abort`` key calls a push off; None: waits are not abortable."""
        self.rank, self.world_size, self.backend, self.device = rank, world_size, backend, device
        self.timeout_s = float(timeout_s)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._slots: list[torch.Tensor | None] = [None, None]
        """The two reused bucket buffers (uint8, viewed as each bucket's dtype; bucket i uses buffer
        i % 2), allocated at the first push of a plan (``slot_sizes``) and kept for the group's life."""
        self._alias: list = [None, None]
        """Per buffer, the non-owning storage the backend's flat tensors are made on (``_alias_storage``)."""
        self._owner: list = [None, None]
        """Per buffer, its own storage (the handed-out tensors share it) and that storage's use count with
        nothing handed out: ``(storage, baseline)``, or None where torch cannot count (``_alias_storage``)."""
        self._handed: list[list] = [[], []]
        """Weak references to the tensors a streamed receive handed out of each buffer (``recv_streamed``)."""
        self.last_push: dict = {}
        """Figures of the last ``send_weights``/``recv_streamed``/``recv_weights`` on this rank."""

    # ------------------------------------------------------------ collectives
    def _wait(self, work) -> None:
        """Wait for ``work`` up to the group's timeout; a dead peer raises here, and a push the driver
        called off raises ``GroupAborted`` within ``PUSH_CALL_OFF_POLL_S`` (module docstring)."""
        if self._calls is None:
            work.wait(self._timeout)
            return
        end = time.monotonic() + self.timeout_s
        finished = _completion(work, self.backend)
        try:
            while not finished(min(PUSH_CALL_OFF_POLL_S, max(0.0, end - time.monotonic()))):
                self._check_called_off()
                if time.monotonic() >= end:
                    break  # the wait below raises the backend's own timeout error
            try:
                work.wait(datetime.timedelta(seconds=max(0.001, end - time.monotonic())))
            except RuntimeError as e:  # a peer that aborted its group (below) breaks ours: say why
                self._check_called_off(e)
                raise
        except GroupAborted:
            self.abort()
            raise

    def abort(self) -> None:
        """Give the group up after a call-off: abort the backend's group (NCCL: ``ncclCommAbort``, whose
        collectives in flight then fail at once; gloo's ``abort`` does nothing in torch 2.13) and drop it in
        a daemon thread of its own. A gloo group's destructor joins its worker threads, and a called-off
        push's work holds them until the group's timeout: dropped here, that wait would stall the caller
        (the next formation, the process's exit); the daemon thread takes it and ends with it, or with the
        process. The group is unusable afterwards: the driver forms a new one."""
        pg, self._pg = self._pg, _CalledOff(self.rank, self.world_size)
        if pg is None or isinstance(pg, _CalledOff):
            return
        try:
            pg.abort()
        except (AttributeError, RuntimeError):  # no abort, or already torn down by a peer's failure
            pass
        held = [pg]
        del pg
        threading.Thread(target=held.clear, name="sonar-abandoned-weight-group", daemon=True).start()

    def _check_called_off(self, cause: BaseException | None = None) -> None:
        """Raise ``GroupAborted`` if the driver called the group off (or rank 0's store is gone), from
        ``cause`` (the backend's error it explains), if any."""
        try:
            called_off = self._calls.check(["abort"])
        except (RuntimeError, OSError) as e:  # DistNetworkError/DistStoreError: rank 0 is gone
            raise GroupAborted(f"weight push at rank {self.rank} of {self.world_size}: rank 0's store is unreachable "
                               f"(the learner died?): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                               ) from (cause or e)
        if called_off:
            raise GroupAborted(f"weight push called off at rank {self.rank} of {self.world_size}: "
                               f"{self._calls.get('abort').decode(errors='replace')}") from cause

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._wait(self._pg.broadcast(tensor, src))

    def _handshake(self, buckets: Sequence[Bucket]) -> None:
        """Rank 0 sends its plan (buckets, elements, layout digest); every rank compares and the mismatches
        are summed, so every rank raises together before any bucket moves (no rank waits on a bucket that
        will never come). Returns once every rank is here: the sender's transfer timing starts after it."""
        specs = [s for b in buckets for s in b.specs]
        mine = torch.tensor([len(buckets), sum(b.numel for b in buckets), int(layout_digest(specs)[:15], 16)],
                            dtype=torch.int64)
        plan = mine.to(self.device) if self.rank == 0 else torch.zeros(3, dtype=torch.int64, device=self.device)
        self.broadcast(plan, 0)
        if self.device.type == "meta":  # a dry run (shapes, no bytes): nothing to read back
            self._wait(self._pg.allreduce([torch.zeros(1, dtype=torch.int64, device=self.device)]))
            return
        theirs = mine if self.rank == 0 else plan.cpu()
        bad = torch.tensor([0 if torch.equal(theirs, mine) else 1], dtype=torch.int64, device=self.device)
        self._wait(self._pg.allreduce([bad]))
        nbad = int(bad.item())
        if nbad:
            here = "" if torch.equal(theirs, mine) else (
                f"; this rank {self.rank} plans {mine.tolist()[:2]} (buckets, elements), the sender "
                f"{theirs.tolist()[:2]}")
            raise RuntimeError(f"weight push refused before any bytes moved: {nbad} rank(s) computed another bucket "
                               f"plan or layout than the sender{here} (model.* config, model.path and the learner's "
                               "dtypes must be the same for every role)")

    # ------------------------------------------------------------ buffers
    def _ensure_slots(self, sizes: Sequence[int]) -> None:
        """Buffer k at least ``sizes[k]`` bytes (``slot_sizes``); kept, and grown only for a larger plan."""
        for i, nbytes in enumerate(sizes):
            raw = self._slots[i]
            if nbytes and (raw is None or raw.numel() < nbytes):
                self._slots[i] = None
                del raw
                self._new_slot(i, nbytes)

    def _new_slot(self, i: int, nbytes: int) -> None:
        """A fresh buffer ``i``. The old one, if any, is dropped: tensors a consumer still holds in it own
        its memory (they share its storage), so it lives exactly as long as they do."""
        self._slots[i] = self._alias[i] = self._owner[i] = None
        self._slots[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._alias[i] = _alias_storage(self._slots[i])
        if self._alias[i] is not None:
            owner = self._slots[i].untyped_storage()
            self._owner[i] = (owner, _use_count(owner))

    def _slot_flat(self, i: int, bucket: Bucket) -> torch.Tensor:
        """Buffer ``i`` as ``bucket``'s flat tensor ([bucket.numel] of its dtype), for the backend: on the
        alias storage where there is one (``_alias_storage``)."""
        if self._alias[i] is None:
            return self._slots[i][:bucket.nbytes].view(bucket.dtype)
        return torch.empty(0, dtype=bucket.dtype, device=self.device).set_(self._alias[i], 0, (bucket.numel,))

    def _slot_tensors(self, i: int, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors in buffer ``i``, for the consumer: tensors sharing the buffer's own storage
        (no copies; they keep its memory alive), made with ``set_`` rather than as views, so they carry
        no reference to a base tensor: once the consumer drops one, nothing of it points into the buffer
        (``_release`` relies on this)."""
        storage = self._slots[i].untyped_storage()
        out, off = [], 0
        for spec in bucket.specs:
            t = torch.empty(0, dtype=bucket.dtype, device=self.device).set_(storage, off, spec.shape)
            out.append((spec.name, t))
            off += spec.numel
        return out

    def _release(self, i: int, stats: dict) -> None:
        """Before buffer ``i`` is received into again: every tensor handed out of it that the consumer
        still holds (vLLM's layerwise reload keeps a layer's checkpoint tensors until the layer is
        complete) gets its own copy (``t.data = t.clone()``: every holder of that tensor sees the copy);
        if the buffer's memory is still referenced after that (the consumer kept a view *derived* from
        one: a weight loader's ``narrow`` or ``t()``, which the copy does not redirect), the buffer is
        left to the holder (whose tensors own it: freed once it lets go) and a fresh one takes its place."""
        for ref in self._handed[i]:
            t = ref()
            if t is not None:
                t.data = t.clone()
                stats["held_copies"] += 1
                stats["held_bytes"] += t.numel() * t.element_size()
            del t
        self._handed[i] = []
        owner = self._owner[i]
        if owner is not None and _use_count(owner[0]) > owner[1]:
            self._new_slot(i, self._slots[i].numel())
            stats["fresh_buffers"] += 1

    def buffer_bytes(self) -> int:
        """Bytes of the two bucket buffers this rank holds now."""
        return sum(s.numel() for s in self._slots if s is not None)

    def _sync(self) -> None:
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------ sender
    def _in_place(self, bucket: Bucket, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """A one-tensor bucket whose tensor is contiguous, of the bucket's dtype and on the group's device
        is its own flat buffer (a broadcast's root only reads it): no copy, no buffer."""
        if len(bucket.specs) != 1:
            return None
        t = tensors[bucket.specs[0].name].detach()
        if t.is_contiguous() and t.dtype == bucket.dtype and t.device == self.device:
            return t.view(-1)
        return None

    def send_weights(self, buckets: Sequence[Bucket], tensors: dict[str, torch.Tensor] | None,
                     gather: Callable[[Bucket], object] | None = None
                     ) -> int:
        """Learner side: push every bucket, streamed through two reused buffers; returns bytes sent per
        receiver. Bucket i+1 is flattened into one buffer while bucket i's broadcast is in flight from the
        other; a buffer is refilled only after its broadcast completed. Returns after the last broadcast
        completed (and, on CUDA, ``torch.cuda.synchronize``): ``last_push`` holds ``seconds`` (the
        transfer, after the handshake), ``wait_s`` (the handshake: the receivers' arrival), ``bytes``,
        ``buckets``, ``in_place`` (buckets sent from the parameter itself) and ``buffer_bytes``.

        The buffers are kept between pushes: filling freshly allocated memory runs at a fraction of
        memcpy speed (measured 3.0 vs 18.7 GB/s here; bench/weight_sync.py).

        ``gather`` (instead of ``tensors``): a context manager per bucket that yields that bucket's tensors
        by name for the block (ZeRO-3 gathers the bucket's parameters, so at most one bucket of full
        parameters exists beside the partitions); each bucket is then copied into a stream buffer inside
        its block, never sent from a tensor that is released when the block ends."""
        if (tensors is None) == (gather is None):  # before the handshake: no receiver is left waiting
            raise ValueError("send_weights: pass the tensors or a per-bucket gather, exactly one")
        t_start = time.perf_counter()
        self._handshake(buckets)
        t0 = time.perf_counter()
        sources = [None if gather is not None else self._in_place(b, tensors) for b in buckets]
        self._ensure_slots(slot_sizes(buckets, [src is None for src in sources]))
        works: list = [None, None]
        sent = 0
        for i, (b, src) in enumerate(zip(buckets, sources)):
            k = i % 2
            if works[k] is not None:  # buffer k's previous broadcast must be done before it is refilled
                self._wait(works[k])
                works[k] = None
            if gather is not None:
                with gather(b) as named:
                    flat = flatten_bucket(b, named, self._slot_flat(k, b))
                    del named
            else:
                flat = src if src is not None else flatten_bucket(b, tensors, self._slot_flat(k, b))
            works[k] = self._pg.broadcast(flat, 0)
            del flat
            sent += b.nbytes
        for k in range(2):
            if works[k] is not None:
                self._wait(works[k])
        works = [None, None]
        self._sync()
        t1 = time.perf_counter()
        self.last_push = {"seconds": t1 - t0, "wait_s": t0 - t_start, "bytes": sent, "buckets": len(buckets),
                          "in_place": sum(src is not None for src in sources), "buffer_bytes": self.buffer_bytes()}
        return sent

    # ------------------------------------------------------------ receivers
    def recv_streamed(self, buckets: Sequence[Bucket], load: Callable[[list[tuple[str, torch.Tensor]]], object],
                      sums: Checksum | None = None) -> dict:
        """Worker side, streamed: the collective with ``send_weights`` through two reused buffers,
        ``load(named)`` called once per bucket, in order, with the bucket's tensors (sharing a buffer: no
        copies) while the next bucket is being received into the other buffer. ``sums``: each tensor is
        added as its bucket arrives (before ``load``). Returns (and keeps in ``last_push``) ``seconds``,
        ``wait_s``, ``load_s``, ``bytes``, ``buckets``, ``buffer_bytes``, ``held_copies``/``held_bytes``
        and ``fresh_buffers``.

        ``load`` may keep tensors past its call (vLLM's layerwise reload keeps a layer's tensors until
        the layer is complete, e.g. ``gate_proj`` until ``up_proj`` arrives in the next bucket): before a
        buffer is refilled, whatever is still held is copied (``_release``; counted in ``held_*``). Peak
        beside the model: the two buffers plus the held copies (the tensors of layers that straddle a
        bucket boundary or wait for the end of the push)."""
        t_start = time.perf_counter()
        self._handshake(buckets)
        t0 = time.perf_counter()
        stats = {"held_copies": 0, "held_bytes": 0, "fresh_buffers": 0}
        self._ensure_slots(slot_sizes(buckets))
        load_s = 0.0

        def post(i: int):
            k = i % 2
            self._release(k, stats)
            return self._pg.broadcast(self._slot_flat(k, buckets[i]), 0)

        nxt = post(0) if buckets else None
        for i, b in enumerate(buckets):
            cur, nxt = nxt, None
            if i + 1 < len(buckets):
                nxt = post(i + 1)  # bucket i+1 arrives in the other buffer while bucket i loads
            self._wait(cur)
            cur = None
            named = self._slot_tensors(i % 2, b)
            if sums is not None:
                _add_all(sums, named)  # (not a loop here: its variable would keep a tensor referenced)
            tl = time.perf_counter()
            load(named)
            load_s += time.perf_counter() - tl
            self._handed[i % 2] = [weakref.ref(t) for _, t in named]
            del named
        self._sync()
        t1 = time.perf_counter()
        self.last_push = {"seconds": t1 - t0, "wait_s": t0 - t_start, "load_s": load_s,
                          "bytes": sum(b.nbytes for b in buckets), "buckets": len(buckets),
                          "buffer_bytes": self.buffer_bytes(), **stats}
        return dict(self.last_push)

    def recv_weights(self, buckets: Sequence[Bucket], into: Sequence[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Worker side, staged: receive every bucket into ``into`` (flat buffers, one per bucket: a full
        staging copy, reused across syncs by the caller, ``alloc_buffers``) or into fresh buffers. Returns
        views by name: a staging copy, never the live model. (The HF engines' receiver, which swaps the
        copy in between generate calls; engines that load as they receive use ``recv_streamed``.)"""
        t_start = time.perf_counter()
        self._handshake(buckets)
        t0 = time.perf_counter()
        out: dict[str, torch.Tensor] = {}
        works = []
        for i, b in enumerate(buckets):
            flat = into[i] if into is not None else torch.empty(b.numel, dtype=b.dtype, device=self.device)
            works.append(self._pg.broadcast(flat, 0))
            out.update(unflatten_bucket(b, flat))
        for w in works:
            self._wait(w)
        self._sync()
        self.last_push = {"seconds": time.perf_counter() - t0, "wait_s": t0 - t_start,
                          "bytes": sum(b.nbytes for b in buckets), "buckets": len(buckets)}
        return out

    def alloc_buffers(self, buckets: Sequence[Bucket]) -> list[torch.Tensor]:
        """One flat buffer per bucket on the group's device: a full staging copy (``recv_weights``)."""
        return [torch.empty(b.numel, dtype=b.dtype, device=self.device) for b in buckets]

    def close(self) -> None:
        if hasattr(self._pg, "close"):  # the hand-over's segment (gloo/NCCL groups go with their last reference)
            self._pg.close()
        self._pg = None
        self._store = None
        self._slots, self._alias, self._owner = [None, None], [None, None], [None, None]
        self._handed = [[], []]
