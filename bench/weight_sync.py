"""weight-sync: how long does one learner -> workers weight push take, and what does bucketing buy?

Question (issue 6): time and GB/s to broadcast 10M to 500M parameters from the learner to 1 to 4
workers over gloo, per-tensor against bucketed, with the count of Ray calls per sync, compared with
the machine's memcpy bandwidth measured in the same run.

Set-up. One Ray actor plays the learner (rank 0, the source) and N actors play rollout workers
(ranks 1..N). They build a ``cluster.weights.BroadcastGroup`` concurrently (group creation blocks until
every rank has joined), exactly as ``sonar.cluster.driver.rollout_pool.RolloutPool.form_group`` does. The parameters are a
transformer-like list of fp32 tensors (``transformer_specs``): per layer q/k/v/o and gate/up/down
matrices plus two RMSNorm weights and q/k/v biases (5 small tensors out of 12), untied embedding and
LM head, a final norm. Real layouts have many small tensors, and per-tensor pushes pay per tensor.

Variants, timed by the driver from issuing the calls to the last reply (what the training loop waits):

- ``bucketed``: ``send_weights`` / ``recv_weights`` with ``plan_buckets`` at the default 128 MB bucket.
  One Ray control call per rank, one collective per bucket. The learner's ``send_weights`` reuses its
  flat send buffers (allocated on the first sync of a layout, inside that sync's timing); each worker
  calls ``recv_weights`` without ``into=``, so it receives into fresh buffers on every sync. This is
  Sonar's learner side with a worker that does not keep its receive buffers.
- ``bucketed_reuse``: the same buckets, but the learner flattens into, and every worker receives into,
  flat buffers allocated (and first touched) once per layout, outside the timing; the per-bucket copy,
  broadcast and ``unflatten_bucket`` are those of ``send_weights`` / ``recv_weights(into=...)``, written
  out in the actor. This is the path Sonar takes: ``send_weights`` on the learner, and
  ``RolloutWorker.receive_weights`` calls ``recv_weights(..., into=...)`` on one of two buffer sets
  allocated once with ``alloc_buffers`` (double buffering). The benchmark keeps one set per rank, which
  costs the same once both of Sonar's sets have been received into once.
- ``per_tensor``: one Ray control call per rank; each rank then loops over the tensors, one
  ``broadcast`` per tensor. Isolates the cost of many small collectives from Ray overhead.
- ``per_tensor_ray``: one Ray call per tensor per rank (OpenRLHF-style: the driver announces each
  parameter, then it is broadcast). Shows the cost of one Ray round trip per tensor.
- ``ray_put``: the naive path: the learner ``ray.put``s its state dict and each worker ``ray.get``s it
  (plasma object store on the same node; no broadcast group at all).

Every variant but ``bucketed_reuse`` lands in fresh receive buffers (as ``recv_weights`` without
``into=`` does), and after every sync each receiver checks the first and last element of every tensor
(untimed), so a fast wrong sync fails the benchmark.

Reported per (size, workers, variant): seconds per sync, GB/s per receiver (bytes of the model / s),
aggregate GB/s (N x bytes / s), Ray calls and collectives per sync; per (size, workers): the time
ratio bucketed / other variant, paired within a repeat (variants are interleaved inside each repeat
so background load hits them alike); once: memcpy GB/s of ``torch.Tensor.copy_`` on one thread, and
bucketed GB/s per receiver as a fraction of it.

Fresh memory. ``recv_weights`` without ``into=`` (the ``bucketed`` receivers) allocates new buffers
on every sync, and on this VM filling fresh memory runs several times slower than memcpy between warm
buffers (3.2 against 18.8 GB/s in the run in bench/README.md; ``first_touch/gbps`` and ``memcpy/gbps``
are measured at the start of every run). That is why Sonar keeps persistent buffers on both sides
(``send_weights``'s send buffers, the worker's two receive sets); ``bucketed`` / ``bucketed_reuse``
measures what they save. Per-tensor receive buffers up to 32 MB are recycled by glibc's heap between
syncs while 128 MB buckets are always fresh mmaps, which is why ``per_tensor`` can beat ``bucketed``
(not ``bucketed_reuse``) here once the model is large.

Repeats. 3 per point; at 500M parameters 2 for bucketed / bucketed_reuse / per_tensor and 1 for the
slow per_tensor_ray and ray_put (2.7-13 s per sync at 500M in the last run), to keep the full run
under about 5 minutes. The variant order rotates from repeat to repeat so the first sync after
a layout change (often the slowest) does not always fall on the same variant. The load average at the
start and end is recorded (``extra.loadavg``): other jobs on a 2-core machine move absolute numbers by
2-5x; the paired ratios move less.

Simplifications. CPU and gloo only (NCCL needs GPUs: not measured). fp32 only. All ranks share one
machine, so with 2 cores and up to five processes the broadcast is CPU-bound and per-receiver
bandwidth falls with N. A variant whose peak memory (``_need_bytes``) would not fit in MemAvailable at
that moment is skipped and listed under ``extra.skipped``: the machine is shared, and an OOM would
kill other people's jobs.
"""
from __future__ import annotations

from sonar.cluster.wire.bootstrap import role_process

role_process()  # first: in an actor's process, its thread and hub settings before torch and transformers load

import gc
import os
import time
from pathlib import Path

from sonar.bench.common import (base_parser, init_ray_local, mem_available_bytes, setup_env, summarise,
                          write_result)

setup_env()

NAME = "weight-sync"
VARIANTS = ("bucketed", "bucketed_reuse", "per_tensor", "per_tensor_ray", "ray_put")
GB = 1e9

# target parameters -> (hidden size d, vocab V); the layer count is solved to hit the target.
MODEL_SHAPES = {
    1_000_000: (128, 2048),
    5_000_000: (256, 4096),
    10_000_000: (256, 8192),
    50_000_000: (512, 16384),
    100_000_000: (768, 32000),
    500_000_000: (1536, 32000),
}
# Points from ``large_from`` parameters run ``repeats_large`` times, and the variants in ``large_single``
# once (see "Repeats" in the module docstring).
FULL = {"params": [10_000_000, 50_000_000, 100_000_000, 500_000_000], "workers": [1, 2, 4], "repeats": 3,
        "repeats_large": 2, "large_from": 500_000_000, "large_single": ["per_tensor_ray", "ray_put"],
        "memcpy_bytes": 512 << 20}
QUICK = {"params": [1_000_000, 5_000_000], "workers": [1, 2], "repeats": 1, "repeats_large": 1,
         "large_from": 500_000_000, "large_single": ["per_tensor_ray", "ray_put"], "memcpy_bytes": 64 << 20}


def _label(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"


def _layer_shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
    ffn = max(64, int(round(8 * d / 3 / 64)) * 64)
    return [("input_norm.weight", (d,)), ("attn.q.weight", (d, d)), ("attn.q.bias", (d,)),
            ("attn.k.weight", (d, d)), ("attn.k.bias", (d,)), ("attn.v.weight", (d, d)), ("attn.v.bias", (d,)),
            ("attn.o.weight", (d, d)), ("post_norm.weight", (d,)), ("mlp.gate.weight", (ffn, d)),
            ("mlp.up.weight", (ffn, d)), ("mlp.down.weight", (d, ffn))]


def transformer_specs(target_params: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a Llama/Qwen-like fp32 model with about ``target_params`` parameters."""
    d, vocab = MODEL_SHAPES[target_params]
    per_layer = sum(_numel(s) for _, s in _layer_shapes(d))
    layers = max(1, round((target_params - 2 * vocab * d - d) / per_layer))
    specs = [("embed.weight", (vocab, d))]
    for i in range(layers):
        specs += [(f"layers.{i}.{n}", s) for n, s in _layer_shapes(d)]
    specs += [("norm.weight", (d,)), ("lm_head.weight", (vocab, d))]
    return specs


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _fill_value(i: int) -> float:
    return float(i % 251 + 1)


class SyncRank:
    """One rank of the broadcast group (rank 0 = learner, the source). Created with ``ray.remote``."""

    def __init__(self, rank: int):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
        self.rank = rank
        self.group = None
        self.specs: list = []
        self.buckets: list = []
        self.src: dict = {}
        self.out: dict | None = None
        self.flats: list | None = None

    def join(self, addr: str, port: int, world_size: int, prefix: str) -> int:
        import torch

        from sonar.cluster.transport.weights import BroadcastGroup

        self.group = BroadcastGroup(addr, port, self.rank, world_size, "gloo", prefix=prefix, timeout_s=600)
        self.group.broadcast(torch.zeros(16), 0)  # first collective opens the gloo pairs: not timed
        return os.getpid()

    def set_layout(self, specs: list, bucket_bytes: int) -> int:
        """Install the tensor layout; the learner (re)allocates its source tensors. Returns bytes."""
        import torch

        from sonar.cluster.transport.weights import TensorSpec, plan_buckets

        self.src, self.out, self.flats = {}, None, None
        gc.collect()
        self.specs = [TensorSpec(n, tuple(s), torch.float32) for n, s in specs]
        self.buckets = plan_buckets(self.specs, bucket_bytes)
        nbytes = sum(s.numel for s in self.specs) * 4
        if self.rank == 0:
            self.src = {s.name: torch.full(s.shape, _fill_value(i)) for i, s in enumerate(self.specs)}
        return nbytes

    def num_buckets(self) -> int:
        return len(self.buckets)

    # -- bucketed: one call per rank, one collective per bucket
    def send_bucketed(self) -> int:
        return self.group.send_weights(self.buckets, self.src)

    def recv_bucketed(self) -> int:
        self.out = None
        self.out = self.group.recv_weights(self.buckets)
        return 0

    # -- bucketed into persistent buffers: no allocation, no page faults inside the timing
    def prepare_reuse(self) -> int:
        import torch

        self.flats = [torch.zeros(b.numel, dtype=b.dtype) for b in self.buckets]  # zeros: pages touched
        return len(self.flats)

    def send_bucketed_reuse(self) -> int:
        for b, flat in zip(self.buckets, self.flats):
            off = 0
            for spec in b.specs:
                flat[off:off + spec.numel].copy_(self.src[spec.name].reshape(-1))
                off += spec.numel
            self.group.broadcast(flat, 0)
        return 0

    def recv_bucketed_reuse(self) -> int:
        from sonar.cluster.transport.weights import unflatten_bucket

        self.out = None
        out = {}
        for b, flat in zip(self.buckets, self.flats):
            self.group.broadcast(flat, 0)
            out.update(unflatten_bucket(b, flat))
        self.out = out
        return 0

    # -- per tensor, looped inside the actor: one call per rank, one collective per tensor
    def send_per_tensor(self) -> int:
        for s in self.specs:
            self.group.broadcast(self.src[s.name], 0)
        return 0

    def recv_per_tensor(self) -> int:
        import torch

        self.out = None
        out = {}
        for s in self.specs:
            t = torch.empty(s.shape, dtype=s.dtype)
            self.group.broadcast(t, 0)
            out[s.name] = t
        self.out = out
        return 0

    # -- per tensor, one Ray call per tensor per rank
    def send_one(self, i: int) -> int:
        self.group.broadcast(self.src[self.specs[i].name], 0)
        return 0

    def recv_one(self, i: int) -> int:
        import torch

        if i == 0:
            self.out = {}
        s = self.specs[i]
        t = torch.empty(s.shape, dtype=s.dtype)
        self.group.broadcast(t, 0)
        self.out[s.name] = t
        return 0

    # -- naive: ray.put the state dict, ray.get it in every worker
    def put_state(self) -> list:
        import ray

        return [ray.put(self.src)]  # wrapped in a list so Ray passes the ref, not the value

    def get_state(self, refs: list) -> int:
        import ray

        self.out = None
        self.out = ray.get(refs[0])
        return 1  # one ray.get

    def verify(self) -> int:
        """Number of tensors whose first or last element is wrong (0 = every tensor arrived)."""
        bad = 0
        for i, s in enumerate(self.specs):
            t = self.out.get(s.name) if self.out else None
            if t is None or tuple(t.shape) != s.shape:
                bad += 1
                continue
            flat = t.reshape(-1)
            v = _fill_value(i)
            bad += int(float(flat[0]) != v or float(flat[-1]) != v)
        return bad

    def clear(self) -> bool:
        self.out = None
        gc.collect()
        return True


def memcpy_gbps(nbytes: int, repeats: int) -> list[float]:
    """GB/s of ``dst.copy_(src)`` on one thread between warm buffers (bytes copied / s)."""
    import torch

    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    out = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(nbytes / (time.perf_counter() - t0) / GB)
    return out


def first_touch_gbps(nbytes: int, repeats: int) -> list[float]:
    """GB/s of filling a freshly allocated buffer (``torch.empty`` + ``fill_``): the page-fault cost that
    every sync pays when it receives into, or flattens into, new memory."""
    import torch

    out = []
    for _ in range(max(3, repeats)):
        gc.collect()
        t0 = time.perf_counter()
        x = torch.empty(nbytes // 4)
        x.fill_(1.0)
        out.append(nbytes / (time.perf_counter() - t0) / GB)
        del x
    return out


class _Driver:
    """Holds the actors of one group size and runs one sync of a variant, counting Ray calls."""

    def __init__(self, ray, n_workers: int):
        from sonar.learner.worker import free_port

        self.ray = ray
        cls = ray.remote(num_cpus=0, max_concurrency=1)(SyncRank)
        self.sender = cls.remote(0)
        self.receivers = [cls.remote(r) for r in range(1, n_workers + 1)]
        self.ranks = [self.sender] + self.receivers
        port = free_port()
        ray.get([a.join.remote("127.0.0.1", port, n_workers + 1, f"bench-ws-{port}") for a in self.ranks],
                timeout=300)
        self.num_tensors = 0

    def set_layout(self, specs, bucket_bytes) -> tuple[int, int]:
        nbytes = self.ray.get([a.set_layout.remote(specs, bucket_bytes) for a in self.ranks])[0]
        self.num_tensors = len(specs)
        return nbytes, self.ray.get(self.sender.num_buckets.remote())

    def sync(self, variant: str) -> tuple[float, int]:
        """One timed sync. Returns (seconds, Ray calls: task submissions + weight put/get)."""
        ray, s, rs = self.ray, self.sender, self.receivers
        t0 = time.perf_counter()
        if variant == "bucketed":
            ray.get([s.send_bucketed.remote()] + [r.recv_bucketed.remote() for r in rs])
            calls = 1 + len(rs)
        elif variant == "bucketed_reuse":
            ray.get([s.send_bucketed_reuse.remote()] + [r.recv_bucketed_reuse.remote() for r in rs])
            calls = 1 + len(rs)
        elif variant == "per_tensor":
            ray.get([s.send_per_tensor.remote()] + [r.recv_per_tensor.remote() for r in rs])
            calls = 1 + len(rs)
        elif variant == "per_tensor_ray":
            for i in range(self.num_tensors):
                ray.get([s.send_one.remote(i)] + [r.recv_one.remote(i) for r in rs])
            calls = self.num_tensors * (1 + len(rs))
        elif variant == "ray_put":
            refs = ray.get(s.put_state.remote())  # learner: 1 call + 1 ray.put
            gets = ray.get([r.get_state.remote(refs) for r in rs])  # N calls + N ray.get
            del refs
            calls = 2 + len(rs) + sum(gets)
        else:
            raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
        return time.perf_counter() - t0, calls

    def prepare_reuse(self) -> None:
        self.ray.get([a.prepare_reuse.remote() for a in self.ranks])

    def verify(self) -> list[int]:
        return self.ray.get([r.verify.remote() for r in self.receivers])

    def clear(self) -> None:
        self.ray.get([r.clear.remote() for r in self.receivers])

    def kill(self) -> None:
        # Free every tensor before the kill: ray.kill returns before the processes exit, and the next
        # point's memory check must not see the old group's gigabytes.
        try:
            self.ray.get([a.set_layout.remote([], 1) for a in self.ranks], timeout=60)
        finally:
            for a in self.ranks:
                self.ray.kill(a)


def _need_bytes(variant: str, nbytes: int, n_workers: int) -> int:
    """Peak memory of a point while ``variant`` runs: the learner's source and one received copy per
    worker, plus the object-store copy (ray_put) or the persistent flat buffers on every rank
    (bucketed_reuse, which stay allocated while the other variants run). 15 % + 1 GiB slack."""
    copies = 1 + n_workers + {"ray_put": 1, "bucketed_reuse": 1 + n_workers}.get(variant, 0)
    return int(copies * nbytes * 1.15) + (1 << 30)


def run(cfg: dict) -> tuple[dict, dict]:
    import ray

    bucket_bytes = cfg["bucket_bytes"]
    metrics: dict = {}
    rows: list[dict] = []
    skipped: list[str] = []
    metrics["memcpy/gbps"] = summarise(memcpy_gbps(cfg["memcpy_bytes"], cfg["repeats"]))
    metrics["first_touch/gbps"] = summarise(first_touch_gbps(cfg["memcpy_bytes"], cfg["repeats"]))
    memcpy = metrics["memcpy/gbps"]["median"]
    print(f"[weight-sync] memcpy {memcpy:.2f} GB/s, first touch {metrics['first_touch/gbps']['median']:.2f} GB/s",
          flush=True)
    largest = max(sum(_numel(s) for _, s in transformer_specs(p)) for p in cfg["params"]) * 4
    owns = init_ray_local(object_store_bytes=max(int(1.3 * largest), 256 << 20))
    try:
        for n in cfg["workers"]:
            drv = _Driver(ray, n)
            try:
                # warm every variant's code path (Ray method tables, gloo buffers) on a tiny layout
                drv.set_layout([("warm.a", (64,)), ("warm.b", (8, 8))], bucket_bytes)
                drv.prepare_reuse()
                for v in VARIANTS:
                    drv.sync(v)
                for p in cfg["params"]:
                    specs = transformer_specs(p)
                    key = f"params={_label(p)}/workers={n}"
                    total = sum(_numel(s) for _, s in specs) * 4
                    avail = mem_available_bytes()
                    variants = []
                    for v in VARIANTS:
                        need = _need_bytes(v, total, n)
                        if avail is not None and need > avail:
                            skipped.append(f"{v} {key}: needs ~{need / 2**30:.1f} GiB, "
                                           f"{avail / 2**30:.1f} GiB available")
                        else:
                            variants.append(v)
                    if "bucketed" not in variants:  # the reference of every ratio: no point without it
                        skipped.append(f"{key}: whole point (bucketed does not fit)")
                        continue
                    nbytes, nbuckets = drv.set_layout(specs, bucket_bytes)
                    if "bucketed_reuse" in variants:
                        drv.prepare_reuse()
                    large = p >= cfg["large_from"]
                    reps = {v: (1 if large and v in cfg["large_single"] else
                                cfg["repeats_large"] if large else cfg["repeats"]) for v in variants}
                    times: dict = {v: [] for v in variants}
                    calls: dict = {}
                    for rep in range(max(reps.values())):
                        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
                        for v in order:  # interleaved: background load hits every variant alike
                            if len(times[v]) >= reps[v]:
                                continue
                            drv.clear()
                            dt, calls[v] = drv.sync(v)
                            times[v].append(dt)
                            bad = drv.verify()  # untimed: first/last element of every tensor
                            if any(bad):
                                raise RuntimeError(f"weight-sync {v} {key}: wrong tensors per receiver {bad}")
                    drv.clear()
                    collectives = {"bucketed": nbuckets, "bucketed_reuse": nbuckets, "per_tensor": len(specs),
                                   "per_tensor_ray": len(specs), "ray_put": 0}
                    for v in variants:
                        metrics[f"{v}/{key}/seconds"] = summarise(times[v])
                        metrics[f"{v}/{key}/gbps_per_receiver"] = summarise(nbytes / t / GB for t in times[v])
                        metrics[f"{v}/{key}/gbps_aggregate"] = summarise(n * nbytes / t / GB for t in times[v])
                        metrics[f"{v}/{key}/ray_calls"] = summarise([calls[v]])
                        metrics[f"{v}/{key}/collectives"] = summarise([collectives[v]])
                    for v in variants:
                        if v != "bucketed":  # paired within a repeat; < 1 means bucketed is faster
                            metrics[f"ratio/bucketed_over_{v}/{key}/time"] = summarise(
                                b / o for b, o in zip(times["bucketed"], times[v]))
                    metrics[f"ratio/bucketed_gbps_over_memcpy/{key}"] = summarise(
                        nbytes / t / GB / memcpy for t in times["bucketed"])
                    rows.append({"params": p, "label": _label(p), "actual_params": nbytes // 4, "bytes": nbytes,
                                 "tensors": len(specs), "buckets": nbuckets, "workers": n, "repeats": reps,
                                 **{f"{v}_s": metrics[f"{v}/{key}/seconds"]["median"] for v in variants},
                                 **{f"{v}_gbps": metrics[f"{v}/{key}/gbps_per_receiver"]["median"] for v in variants},
                                 **{f"{v}_calls": calls[v] for v in variants}})
                    print(f"[weight-sync] {key} ({nbytes / 2**20:.0f} MiB, {len(specs)} tensors, {nbuckets} buckets, "
                          f"repeats {max(reps.values())}): "
                          + ", ".join(f"{v} {metrics[f'{v}/{key}/seconds']['median']:.3f}s "
                                      f"({metrics[f'{v}/{key}/gbps_per_receiver']['median']:.2f} GB/s, "
                                      f"{calls[v]} calls)" for v in variants), flush=True)
            finally:
                drv.kill()
                gc.collect()
    finally:
        if owns:
            ray.shutdown()
    return metrics, {"table": rows, "skipped": skipped}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def plot(metrics: dict, extra: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    rows = extra["table"]
    workers = sorted({r["workers"] for r in rows})
    memcpy = metrics["memcpy/gbps"]["median"]
    touch = metrics["first_touch/gbps"]["median"]
    fig, axes = plt.subplots(2, max(1, len(workers)), figsize=(5 * max(1, len(workers)), 8), squeeze=False)
    styles = {"bucketed": "o-", "bucketed_reuse": "x-", "per_tensor": "s--", "per_tensor_ray": "^:", "ray_put": "d-."}
    for j, n in enumerate(workers):
        sub = sorted((r for r in rows if r["workers"] == n), key=lambda r: r["params"])
        for v in VARIANTS:
            sub_v = [r for r in sub if f"{v}/params={r['label']}/workers={n}/seconds" in metrics]
            if not sub_v:
                continue
            xs = [r["actual_params"] for r in sub_v]
            ms = [metrics[f"{v}/params={r['label']}/workers={n}/gbps_per_receiver"] for r in sub_v]
            med = [m["median"] for m in ms]
            err = [[m["median"] - m["min"] for m in ms], [m["max"] - m["median"] for m in ms]]
            axes[0][j].errorbar(xs, med, yerr=err, fmt=styles[v], capsize=3, label=v)
            ss = [metrics[f"{v}/params={r['label']}/workers={n}/seconds"]["median"] for r in sub_v]
            axes[1][j].plot(xs, ss, styles[v], label=v)
        axes[0][j].axhline(memcpy, color="k", lw=1, ls="--", label=f"memcpy {memcpy:.1f} GB/s")
        axes[0][j].axhline(touch, color="grey", lw=1, ls=":", label=f"first touch {touch:.1f} GB/s")
        axes[0][j].set(xscale="log", yscale="log", title=f"{n} worker(s): GB/s per receiver",
                       xlabel="parameters (fp32)", ylabel="GB/s")
        axes[1][j].set(xscale="log", yscale="log", title=f"{n} worker(s): seconds per sync",
                       xlabel="parameters (fp32)", ylabel="s")
        for ax in axes[:, j]:
            ax.set_xticks([r["actual_params"] for r in sub], [r["label"] for r in sub])
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
        for ax in axes[:, j]:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("weight-sync: learner -> N workers over gloo (Ray actors, one machine); median, bars = min..max")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# bench/README.md's rendering of a result (pure: no runs; `sonar bench readme`, tests/bench/test_readme_blocks.py)

def _spread(m: dict, form: str, unit: str = "") -> str:
    """A summary's median[ unit] [min–max], or ``(n=1)`` for a single repeat."""
    if m["n"] == 1:
        return f"{form.format(m['median'])}{unit} (n=1)"
    return f"{form.format(m['median'])}{unit} [{form.format(m['min'])}–{form.format(m['max'])}]"


def render_times_table(doc: dict, json_name: str) -> str:
    """bench/README.md's first weight-sync table: per point and variant, seconds per sync median [min–max],
    GB/s per receiver and Ray calls per sync; a variant the memory guard skipped says so."""
    from sonar.bench.common import readme_block

    m, variants = doc["metrics"], doc["config"]["variants"]
    lines = ["| params (actual) | workers | tensors / buckets | " + " | ".join(variants) + " |",
             "|---|---|---|" + "---|" * len(variants)]
    for r in doc["extra"]["table"]:
        key = f"params={r['label']}/workers={r['workers']}"
        cells = [f"{_spread(m[f'{v}/{key}/seconds'], '{:.3f}', ' s')}, "
                 f"{m[f'{v}/{key}/gbps_per_receiver']['median']:.2f} GB/s, {r[f'{v}_calls']} calls"
                 if f"{v}/{key}/seconds" in m else "skipped (memory)" for v in variants]
        size = f"{r['label']} ({r['actual_params'] / 1e6:.1f}M, {r['bytes'] / 2**20:.0f} MiB)"
        lines.append(f"| {size} | {r['workers']} | {r['tensors']} / {r['buckets']} | " + " | ".join(cells) + " |")
    return readme_block("weight-sync times", json_name, lines)


def render_ratios_table(doc: dict, json_name: str) -> str:
    """bench/README.md's second weight-sync table: bucketed's time over each other variant's, paired per
    repeat (median [min–max]); the other variants' median times over bucketed_reuse's (not paired); GB/s per
    receiver over memcpy's."""
    from sonar.bench.common import readme_block

    m = doc["metrics"]
    others = [v for v in doc["config"]["variants"] if v != "bucketed"]
    memcpy = m["memcpy/gbps"]["median"]
    slower = [v for v in others if v != "bucketed_reuse"]
    lines = ["| params | workers | " + " | ".join(f"bucketed / {v}" for v in others) + " | bucketed ÷ memcpy | "
             + " | ".join(f"{v} ÷ bucketed_reuse" for v in slower) + " | bucketed_reuse ÷ memcpy |",
             "|---|---|" + "---|" * (2 * len(others) + 1)]
    for r in doc["extra"]["table"]:
        key = f"params={r['label']}/workers={r['workers']}"
        paired = [_spread(m[f"ratio/bucketed_over_{v}/{key}/time"], "{:.2f}") if f"ratio/bucketed_over_{v}/{key}/time"
                  in m else "–" for v in others]
        reuse = r.get("bucketed_reuse_s")
        over_reuse = [f"{r[f'{v}_s'] / reuse:.2f}" if reuse and f"{v}_s" in r else "–" for v in slower]
        reuse_memcpy = f"{r['bucketed_reuse_gbps'] / memcpy:.3f}" if reuse else "–"
        lines.append(f"| {r['label']} | {r['workers']} | " + " | ".join(paired)
                     + f" | {m[f'ratio/bucketed_gbps_over_memcpy/{key}']['median']:.3f} | "
                     + " | ".join(over_reuse) + f" | {reuse_memcpy} |")
    return readme_block("weight-sync ratios", json_name, lines)


def main(argv: list[str] | None = None) -> int:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--params", type=int, nargs="+", choices=sorted(MODEL_SHAPES), help="model sizes")
    p.add_argument("--workers", type=int, nargs="+", help="receiver counts")
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.params:
        cfg["params"] = args.params
    if args.workers:
        cfg["workers"] = args.workers
    if args.repeats:  # an explicit count applies to every point and variant
        cfg["repeats"] = cfg["repeats_large"] = args.repeats
        cfg["large_single"] = []
    from sonar.cluster.transport.weights import DEFAULT_BUCKET_BYTES

    cfg.update(quick=args.quick, bucket_bytes=DEFAULT_BUCKET_BYTES, backend="gloo", dtype="float32",
               variants=list(VARIANTS), timing="driver wall clock from issuing the calls to the last reply",
               layouts={_label(p): {"tensors": len(transformer_specs(p)),
                                    "params": sum(_numel(s) for _, s in transformer_specs(p)),
                                    "hidden_vocab": MODEL_SHAPES[p]} for p in cfg["params"]})
    t0, load0 = time.time(), _loadavg()
    metrics, extra = run(cfg)
    extra["wall_s"] = round(time.time() - t0, 1)
    extra["loadavg"] = {"start": load0, "end": _loadavg(), "what": "1, 5, 15 min load averages (os.getloadavg)"}
    path = write_result(NAME, cfg, metrics, lambda png: plot(metrics, extra, png), args.out, extra=extra)
    print(f"[weight-sync] wrote {path} and {path.with_suffix('.png').name} in {extra['wall_s']} s")
    for s in extra["skipped"]:
        print(f"[weight-sync] skipped {s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
