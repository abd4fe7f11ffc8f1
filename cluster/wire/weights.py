"""The weight-broadcast group and the bucketed weight push.

One torch.distributed process group spans the learner (rank 0, the source) and every rollout worker
(ranks 1..N). It is *stateless*: built directly on a TCPStore + PrefixStore instead of the global
default group, so it coexists with DeepSpeed's own group inside the learner process and can be
rebuilt (new prefix) when a worker is restarted. NCCL on GPU, gloo on CPU.

Tensors travel in flat buckets of ``bucket_bytes`` (one dtype per bucket): one collective per bucket
instead of one per parameter, which is what makes the push cheap. Only a small "version v ready"
message travels through Ray. Every rank must call ``GroupMember.create`` concurrently: group creation
blocks until all ranks have joined.

Sockets stay on the address they were given: rank 0's store listens on ``master_addr`` only (torch's
own master TCPStore would listen on every interface) and each rank's gloo pair sockets on the local
address that reaches ``master_addr`` (127.0.0.1 for a local run); see :func:`master_store`.
"""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import socket
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 128 << 20


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
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


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


def flatten_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors, in spec order, into the flat buffer ``out`` ([bucket.numel]) and return
    it; :func:`unflatten_bucket` is the inverse. ``out`` is reused across syncs by the sender."""
    off = 0
    for spec in bucket.specs:
        out[off:off + spec.numel].copy_(tensors[spec.name].detach().reshape(-1))
        off += spec.numel
    return out


def unflatten_bucket(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views into ``flat`` (no copies): the caller copies them into the model."""
    off = 0
    for spec in bucket.specs:
        yield spec.name, flat[off:off + spec.numel].view(spec.shape)
        off += spec.numel


def checksum(named: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Order-independent float64 checksum: equal on every rank that holds the same weights."""
    total = 0.0
    for name, t in named:
        w = (int(hashlib.md5(name.encode()).hexdigest()[:6], 16) % 997) + 1
        total += w * float(t.detach().double().abs().sum())
    return total


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


class BroadcastGroup:
    """A stateless process group for the weight push. Rank 0 is the learner.

    ``store``: rank 0 may pass the store :func:`open_store` bound (then ``master_port`` is its port);
    otherwise rank 0 binds ``master_port`` itself and every other rank dials it."""

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
                 prefix: str = "sonar-weights", timeout_s: float = 300.0, store: dist.TCPStore | None = None):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"broadcast backend={backend!r} is not 'gloo' or 'nccl'")
        if store is not None and (rank != 0 or store.port != master_port):
            raise ValueError(f"BroadcastGroup: a bound store (port {store.port}) is rank 0's, for master_port "
                             f"{master_port}; got rank {rank}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is not None:
            self._store = store
        elif rank == 0:
            self._store = master_store(master_addr, master_port, world_size, timeout_s, wait_for_workers=True)
        else:
            self._store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
        store = dist.PrefixStore(prefix, self._store)
        if backend == "gloo":  # pair sockets on the interface that reaches master_addr, nowhere else
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, gloo_options(master_addr, timeout))
            self.device = torch.device("cpu")
        else:  # pragma: no cover - needs CUDA
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size)
            self.device = torch.device("cuda", torch.cuda.current_device())

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._pg.broadcast(tensor, src).wait()

    def send_weights(self, buckets: Sequence[Bucket], tensors: dict[str, torch.Tensor]) -> int:
        """Learner side: push every bucket. Returns bytes sent per receiver.

        The flat send buffers are allocated once and reused: filling freshly allocated memory runs at a
        fraction of memcpy speed (measured 3.0 vs 18.7 GB/s here), which made per-sync allocation the
        bottleneck above ~50M parameters (bench/weight_sync.py)."""
        key = tuple(buckets)
        if getattr(self, "_send_key", None) != key:
            self._send_key, self._send_bufs = key, self.alloc_buffers(buckets)
        sent = 0
        for b, flat in zip(buckets, self._send_bufs):
            self.broadcast(flatten_bucket(b, tensors, flat), 0)
            sent += b.nbytes
        return sent

    def recv_weights(self, buckets: Sequence[Bucket], into: Sequence[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Worker side: receive every bucket into ``into`` (preallocated flat buffers, one per bucket,
        reused across syncs by the caller) or into fresh buffers. Returns views by name: a staging copy,
        never the live model."""
        out: dict[str, torch.Tensor] = {}
        for i, b in enumerate(buckets):
            flat = into[i] if into is not None else torch.empty(b.numel, dtype=b.dtype, device=self.device)
            self.broadcast(flat, 0)
            out.update(unflatten_bucket(b, flat))
        return out

    def alloc_buffers(self, buckets: Sequence[Bucket]) -> list[torch.Tensor]:
        return [torch.empty(b.numel, dtype=b.dtype, device=self.device) for b in buckets]

    def close(self) -> None:
        self._pg = None
        self._store = None
