"""The streamed weight push (cluster/transport/weights.py, issue 21 item 3 and the push parts of 8/9): two
bucket buffers on each side whatever the bucket count, a receiver that loads bucket by bucket and never
lets a buffer be refilled under a tensor its loader still holds, the streamed result bit-identical to
the staged full copy over a real gloo group, a chunked float64 checksum with a bounded temporary, push
timing that covers completion, a timeout that turns a dead peer into an error at the call, and a send
path that hands the backend only tensors on the group's device.

Allocations are counted with a ``TorchDispatchMode`` in the rank's own thread: every op output whose
storage is none of the op's inputs' is a new allocation, so hidden copies count too."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

import sonar.cluster.transport.weights as W
from sonar.cluster.transport.weights import (BroadcastGroup, Checksum, TensorSpec, checksum, name_weight, plan_buckets,
                                        recv_buffer_bytes, send_buffer_bytes)
from sonar.learner.worker import free_port

DEADLINE_S = 60.0


def specs_of(tensors):
    return [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equality of these is bit-for-bit (NaN payloads, -0.0 included)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


class Allocations(TorchDispatchMode):
    """Records the bytes of every new storage an op creates in this thread (and float64 outputs' sizes)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []
        """Bytes of each new storage, float64 ones (the checksum's temporaries) left out."""
        self.float64_numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()
        for x in tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor):
                inputs.add(x.untyped_storage().data_ptr())
            elif isinstance(x, torch.UntypedStorage):  # set_(storage, ...): the tensor takes that storage
                inputs.add(x.data_ptr())
        seen = set()
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if t.dtype == torch.float64:
                self.float64_numels.append(t.numel())
                continue
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in inputs and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                self.sizes.append(st.nbytes())
        return out


def run_ranks(n: int, fn, timeout_s: float = 30.0) -> dict:
    """``fn(rank, group)`` on ``n`` threads, one gloo rank each (TCPStore on 127.0.0.1)."""
    port = free_port()
    results: dict = {}
    errors: list = []

    def target(r):
        try:
            g = BroadcastGroup("127.0.0.1", port, r, n, "gloo", prefix="stream", timeout_s=timeout_s)
            results[r] = fn(r, g)
        except BaseException as e:  # surfaced below
            errors.append((r, e))

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors
    return results


# ------------------------------------------------------------------ sender

@pytest.mark.parametrize("n_buckets", [3, 12])
def test_the_sender_allocates_two_bucket_buffers_whatever_the_bucket_count(n_buckets):
    torch.manual_seed(0)
    src = {f"w{i}": torch.randn(100) for i in range(2 * n_buckets)}  # float32: 400 B each
    buckets = plan_buckets(specs_of(src), bucket_bytes=800)          # two tensors per bucket
    assert len(buckets) == n_buckets and {b.nbytes for b in buckets} == {800}

    def fn(r, g):
        if r == 0:
            with Allocations() as first:
                g.send_weights(buckets, src)
            with Allocations() as second:
                g.send_weights(buckets, src)
            return first, second, dict(g.last_push)
        return [{k: v.clone() for k, v in g.recv_weights(buckets).items()} for _ in range(2)]

    out = run_ranks(2, fn)
    first, second, push = out[0]
    big = [n for n in first.sizes if n >= 400]
    assert big == [800, 800]                     # exactly two buffers of the largest bucket, not one per bucket
    assert sum(first.sizes) <= 2 * 800 + 64      # + the handshake's two tiny int64 tensors
    assert [n for n in second.sizes if n >= 400] == []  # later pushes reuse them
    assert push["buffer_bytes"] == 1600 == send_buffer_bytes(buckets) and push["in_place"] == 0
    assert push["bytes"] == 800 * n_buckets and push["buckets"] == n_buckets
    for got in out[1]:
        assert all(torch.equal(got[k], v) for k, v in src.items())


def test_a_one_tensor_bucket_already_in_place_is_sent_from_the_tensor_itself():
    torch.manual_seed(1)
    src = {"embed": torch.randn(40, 25), "a": torch.randn(10), "b": torch.randn(10), "steps": torch.arange(5),
           "head": torch.randn(25, 40).t()}  # non-contiguous: it has to be flattened
    buckets = plan_buckets(specs_of(src), bucket_bytes=256)
    assert [[s.name for s in b.specs] for b in buckets] == [["embed"], ["a", "b"], ["steps"], ["head"]]

    def fn(r, g):
        if r == 0:
            with Allocations() as a:
                g.send_weights(buckets, src)
            return a, dict(g.last_push)
        return {k: v.clone() for k, v in g.recv_weights(buckets).items()}

    out = run_ranks(2, fn)
    a, push = out[0]
    assert push["in_place"] == 2                           # embed and steps: no copy
    # Only buckets 1 (a+b, 80 B) and 3 (head, 4000 B) are flattened, both through buffer 1 (odd).
    assert push["buffer_bytes"] == 4000
    assert [n for n in a.sizes if n >= 40] == [4000]       # and no temporary for the non-contiguous one
    # The plan's figures: contiguous parameters on the group's device (only a+b flattened), or none.
    assert send_buffer_bytes(buckets) == 80 and send_buffer_bytes(buckets, in_place=False) == 4000 + 4000
    assert all(torch.equal(out[1][k], v) for k, v in src.items())


# ------------------------------------------------------------------ receiver

class LayerwiseLoader:
    """vLLM's layerwise reload in miniature: each call gets one bucket's tensors; a tensor is kept (not
    copied) until every tensor of its layer has arrived, then the layer is "loaded" (copied into
    ``model``). ``at_end``: layers completed only by ``finish()`` (vLLM's finalize: a padded embedding).
    At every call it checks that every tensor it still holds has the sender's bytes: a receiver that
    refilled a buffer under a held tensor fails here. ``derived``: layers kept as a view *derived* from
    the tensor handed in (the tensor object itself dropped)."""

    def __init__(self, layers: dict[str, str], expected: dict[str, torch.Tensor], at_end=(), derived=(),
                 group: BroadcastGroup | None = None):
        self.layer_of = layers
        self.size = {}
        for n, layer in layers.items():
            self.size[layer] = self.size.get(layer, 0) + 1
        self.expected, self.at_end, self.derived, self.group = expected, set(at_end), set(derived), group
        self.pending: dict[str, list] = {}
        self.model: dict[str, torch.Tensor] = {}
        self.calls: list[list[str]] = []
        self.buffer_bytes: list[int] = []

    def _check_held(self):
        for held in self.pending.values():
            for name, t in held:
                assert torch.equal(bits(t), bits(self.expected[name])), f"{name} was overwritten while held"

    def __call__(self, named):
        with _disable_current_modes():  # the test's own copies are not the receiver's allocations
            self.calls.append([n for n, _ in named])
            if self.group is not None:
                self.buffer_bytes.append(self.group.buffer_bytes())
            self._check_held()
            for name, t in named:
                layer = self.layer_of[name]
                keep = t.view(-1).narrow(0, 0, t.numel()) if layer in self.derived else t
                self.pending.setdefault(layer, []).append((name, keep))
                if len(self.pending[layer]) == self.size[layer] and layer not in self.at_end:
                    self._load(layer)

    def _load(self, layer):
        for name, t in self.pending.pop(layer):
            self.model[name] = t.clone().reshape(self.expected[name].shape)

    def finish(self):
        self._check_held()
        for layer in list(self.pending):
            self._load(layer)


def eight_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(100, generator=g) for i in range(8)}  # 400 B each; 2 per 800 B bucket


# t0: held to the end (finalize); t1+t2 and t5+t6 straddle a bucket boundary; the rest complete at once.
LAYERS = {"t0": "embed", "t1": "gate_up.0", "t2": "gate_up.0", "t3": "down.0", "t4": "norm.0", "t5": "gate_up.1",
          "t6": "gate_up.1", "t7": "down.1"}


def test_the_receiver_loads_bucket_by_bucket_in_two_buffers_and_copies_only_what_the_loader_holds():
    pushes = [eight_tensors(2), eight_tensors(3)]
    buckets = plan_buckets(specs_of(pushes[0]), bucket_bytes=800)
    assert [[s.name for s in b.specs] for b in buckets] == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6", "t7"]]

    def fn(r, g):
        if r == 0:
            for w in pushes:
                g.send_weights(buckets, w)
            return None
        out = []
        for w in pushes:
            loader = LayerwiseLoader(LAYERS, w, at_end={"embed"}, group=g)
            sums = Checksum()
            with Allocations() as a:
                stats = g.recv_streamed(buckets, loader, sums)
            loader.finish()
            out.append((loader, stats, a, sums.value))
        return out

    for (loader, stats, a, ck), w in zip(run_ranks(2, fn)[1], pushes):
        assert loader.calls == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6", "t7"]]  # one call per bucket
        assert all(torch.equal(bits(loader.model[n]), bits(w[n])) for n in w)
        assert loader.buffer_bytes == [1600] * 4 == [recv_buffer_bytes(buckets)] * 4
        # Buffer 0 is refilled (bucket 2) while bucket 1 loads: t0 (finalize) and t1 (waits for t2) are
        # still held then and are copied; nothing else is. Buffer 1 is not refilled in a 4-bucket push.
        assert (stats["held_copies"], stats["held_bytes"], stats["fresh_buffers"]) == (2, 800, 0)
        big = sorted(n for n in a.sizes if n >= 400)
        assert big == ([400, 400, 800, 800] if w is pushes[0] else [400, 400])  # buffers once, then the copies
        assert ck == checksum(w.items())   # summed as it arrived, same order and chunks: the same float
        assert stats["bytes"] == 3200 and stats["buckets"] == 4


def test_a_view_derived_from_a_handed_tensor_keeps_its_buffer_and_a_fresh_one_takes_its_place():
    w = eight_tensors(4)
    buckets = plan_buckets(specs_of(w), bucket_bytes=800)

    def fn(r, g):
        if r == 0:
            g.send_weights(buckets, w)
            return None
        loader = LayerwiseLoader(LAYERS, w, derived={"gate_up.0"})
        stats = g.recv_streamed(buckets, loader)
        loader.finish()
        return loader, stats

    loader, stats = run_ranks(2, fn)[1]
    assert all(torch.equal(bits(loader.model[n]), bits(w[n])) for n in w)
    # t1 is held through a narrowed view of it (what a weight loader makes): the view's base keeps t1
    # alive, so t1 gets its copy, but the view still points into buffer 0, which is left to it.
    assert (stats["held_copies"], stats["fresh_buffers"]) == (1, 1)


def test_the_streamed_push_equals_the_staged_full_copy_bit_for_bit_over_gloo():
    torch.manual_seed(5)
    a = {"embed": torch.randn(64, 16).to(torch.bfloat16), "q.w": torch.randn(16, 16).to(torch.bfloat16),
         "q.b": torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.0, -2.5]),
         "norm": torch.randn(16), "steps": torch.arange(7), "mask": torch.tensor([True, False, True])}
    b = {k: (v + 1 if v.dtype not in (torch.bool,) else ~v) for k, v in a.items()}
    buckets = plan_buckets(specs_of(a), bucket_bytes=600)
    assert len(buckets) >= 4 and len({x.dtype for x in buckets}) == 4

    def copy_into(model):
        return lambda named: model.update({n: t.clone() for n, t in named})

    def fn(r, g):
        if r == 0:
            for w in (a, a, b, a):
                g.send_weights(buckets, w)
            return None
        staged = {k: v.clone() for k, v in g.recv_weights(buckets).items()}   # the old path: a full copy
        streamed = [{}, {}, {}]
        for m in streamed:
            g.recv_streamed(buckets, copy_into(m))
        return staged, streamed

    staged, (s_a, s_b, s_a2) = run_ranks(2, fn)[1]
    for k in a:
        assert torch.equal(bits(s_a[k]), bits(staged[k])) and torch.equal(bits(staged[k]), bits(a[k]))
        assert torch.equal(bits(s_b[k]), bits(b[k])) and torch.equal(bits(s_a2[k]), bits(a[k]))  # buffers reused


def test_a_receiver_with_another_plan_fails_every_rank_before_bytes_move():
    w = eight_tensors(6)
    mine = plan_buckets(specs_of(w), bucket_bytes=800)
    other = plan_buckets(specs_of(w), bucket_bytes=1200)
    errors: dict[int, BaseException] = {}

    def fn(r, g):
        try:
            if r == 0:
                g.send_weights(mine, w)
            else:
                g.recv_streamed(other, lambda named: None)
        except RuntimeError as e:
            errors[r] = e

    run_ranks(2, fn)
    assert set(errors) == {0, 1}
    assert all("refused before any bytes moved: 1 rank(s)" in str(e) for e in errors.values())
    assert "plans [3, 800] (buckets, elements), the sender [4, 800]" in str(errors[1])


# ------------------------------------------------------------------ checksum

def old_checksum(named) -> float:
    """The checksum before chunking: a whole-tensor float64 copy per tensor."""
    total = 0.0
    for name, t in named:
        total += name_weight(name) * float(t.detach().double().abs().sum())
    return total


def test_the_chunked_checksum_equals_the_whole_tensor_float64_sum_with_a_bounded_temporary(monkeypatch):
    monkeypatch.setattr(W, "CHECKSUM_CHUNK_ELEMS", 1000)
    g = torch.Generator().manual_seed(7)
    named = [("big", torch.randn(10_007, generator=g) * 1e3),                 # 10 chunks and a bit
             ("wide.t", torch.randn(30, 700, generator=g).t()),               # non-contiguous, rows of 30
             ("rows", torch.randn(3, 2500, generator=g)[:, ::2]),             # non-contiguous, a row > a chunk
             ("bf16", torch.randn(4096, generator=g).to(torch.bfloat16)),
             ("small", torch.randn(999, generator=g)), ("int", torch.arange(-50, 50))]
    with Allocations() as a:
        got = checksum(named)
    want = old_checksum(named)
    assert got == pytest.approx(want, rel=1e-12, abs=0)   # chunking changes only the float64 rounding
    assert max(a.float64_numels) <= 1000                  # no float64 temporary larger than a chunk
    with Allocations() as a_old:
        old_checksum(named[:1])
    assert max(a_old.float64_numels) == 10_007            # the old function: the whole tensor in float64
    # A tensor of at most one chunk gives the old number exactly; the order of the tensors does not matter.
    assert checksum(named[4:]) == old_checksum(named[4:])
    assert checksum(named[::-1]) == pytest.approx(got, rel=1e-15)
    assert W.CHECKSUM_CHUNK_BYTES == 8 * (1 << 22)


# ------------------------------------------------------------------ timing, timeout, devices

class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class TimedWork:
    def __init__(self, clock, cost):
        self.clock, self.cost = clock, cost

    def wait(self, timeout=None):
        self.clock.now += self.cost  # the collective "completes" only when waited for
        return True


class TimedPG:
    """Handshake collectives take 5 s each, every bucket 1 s: the figures have closed forms."""

    def __init__(self, clock):
        self.clock, self.calls = clock, 0

    def _work(self):
        self.calls += 1
        return TimedWork(self.clock, 5.0 if self.calls <= 2 else 1.0)

    def broadcast(self, tensor, root):
        return self._work()

    def allreduce(self, tensors):
        return self._work()


def test_push_timing_covers_completion_and_leaves_out_the_wait_for_receivers(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(W, "time", clock)
    src = {f"w{i}": torch.randn(100) for i in range(10)}
    buckets = plan_buckets(specs_of(src), bucket_bytes=800)  # 5 buckets
    g = BroadcastGroup.over(TimedPG(clock), 0, 2, "cpu")
    assert g.send_weights(buckets, src) == 4000
    assert (g.last_push["seconds"], g.last_push["wait_s"]) == (5 * 1.0, 2 * 5.0)

    # The learner's broadcast() reports that transfer, not the enqueue.
    import types
    from contextlib import contextmanager

    import sonar.learner.worker as LW

    monkeypatch.setattr(LW, "time", clock)
    clock.now = 100.0
    g2 = BroadcastGroup.over(TimedPG(clock), 0, 2, "cpu")

    @contextmanager
    def gathered(params):
        assert params == list(src.items())  # what a push moves (``_pushed``)
        yield src

    fake = types.SimpleNamespace(_peers=[], _fanning=False, rank=0, version=7, _group=g2, _buckets=buckets,
                                 _gathered=gathered, _pushed=lambda: list(src.items()),
                                 cfg=types.SimpleNamespace(learner=types.SimpleNamespace(zero_stage=0)))
    out = LW.Learner.broadcast(fake)
    assert (out["seconds"], out["wait_s"], out["wall_s"], out["bytes"]) == (5.0, 10.0, 15.0, 4000)


def test_a_dead_receiver_makes_the_senders_push_raise_within_the_timeout():
    port = free_port()
    groups: dict[int, BroadcastGroup] = {}

    def join(r):
        groups[r] = BroadcastGroup("127.0.0.1", port, r, 2, "gloo", prefix="dead", timeout_s=2.0)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    src = {"w": torch.randn(100)}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="(?i)timed out"):
        groups[0].send_weights(plan_buckets(specs_of(src)), src)  # rank 1 joined and never receives
    assert time.monotonic() - t0 < 30.0  # the group's 2 s, not gloo's or NCCL's defaults (minutes)


class RecordingPG:
    class Done:
        def wait(self, timeout=None):
            return True

    def __init__(self):
        self.devices: list[str] = []

    def broadcast(self, tensor, root):
        self.devices.append(tensor.device.type)
        return self.Done()

    def allreduce(self, tensors):
        self.devices += [t.device.type for t in tensors]
        return self.Done()


def test_every_tensor_the_push_hands_the_backend_lives_on_the_groups_device():
    """What an NCCL group needs (torch 2.13's has no CPU backend): with the group on a device that is not
    the parameters' (meta here, CUDA on a GPU), nothing of the CPU-side parameters reaches the backend
    uncopied, on either side, handshake included."""
    src = {"embed": torch.randn(40, 25), "a": torch.randn(10), "b": torch.randn(10), "steps": torch.arange(5)}
    buckets = plan_buckets(specs_of(src), bucket_bytes=256)
    pg = RecordingPG()
    sender = BroadcastGroup.over(pg, 0, 2, "meta")
    sender.send_weights(buckets, src)
    assert pg.devices == ["meta"] * (2 + len(buckets)) and sender.last_push["in_place"] == 0
    pg2, seen = RecordingPG(), []
    receiver = BroadcastGroup.over(pg2, 1, 2, "meta")
    receiver.recv_streamed(buckets, lambda named: seen.extend(t.device.type for _, t in named))
    assert pg2.devices == ["meta"] * (2 + len(buckets)) and seen == ["meta"] * len(src)


def test_a_timeout_that_is_not_positive_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"timeout_s=0 must be > 0"):
        BroadcastGroup.over(RecordingPG(), 0, 2, "cpu", timeout_s=0)


# ------------------------------------------------------------------ the HF engines' receiver

class FakeHFEngine:
    def __init__(self, specs):
        self.version, self.loaded, self.generated = 0, [], 0
        self._specs = specs

    def parameter_specs(self):
        return self._specs

    def load_weights(self, named, version):
        self.loaded.append((version, {n: t.clone() for n, t in named}))
        self.version = version

    def generate(self, prompts, params, caps=None):
        self.generated += 1
        return []


def test_the_hf_receiver_reuses_one_staging_set_and_installs_only_complete_versions():
    from sonar.actors.engine import ParamSpec
    from sonar.actors.worker import RolloutWorker, SwappingEngine

    pushes = [eight_tensors(8), eight_tensors(9)]
    specs = [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in pushes[0].items()]
    buckets = plan_buckets(specs_of(pushes[0]), bucket_bytes=800)
    inner = FakeHFEngine(specs)
    worker = RolloutWorker.__new__(RolloutWorker)
    worker.worker_id, worker.engine, worker._buckets = 0, SwappingEngine(inner), buckets

    def fn(r, g):
        if r == 0:
            for w in pushes:
                g.send_weights(buckets, w)
            return None
        worker._group = g
        ptrs = []
        for v in (1, 2):
            worker.receive_weights(v)
            ptrs.append([b.data_ptr() for b in worker.engine.buffers])
        return ptrs

    ptrs = run_ranks(2, fn)[1]
    assert len(ptrs[0]) == len(buckets) and ptrs[0] == ptrs[1]   # one staging set, allocated once
    assert worker.engine.next_version == 2 and inner.loaded == []
    # A receive writing the staging set (its lock held) does not block generate, which installs nothing.
    with worker.engine.buffer_lock:
        worker.engine.generate([], None)
    assert inner.generated == 1 and inner.loaded == []
    worker.engine.generate([], None)
    # Version 1 was overwritten before any generate: only version 2 is ever installed.
    assert [v for v, _ in inner.loaded] == [2]
    assert all(torch.equal(inner.loaded[0][1][n], pushes[1][n]) for n in pushes[1])


def test_a_per_bucket_gather_is_entered_once_per_bucket_in_order_and_sends_the_same_bits():
    """ZeRO-3's push (learner/worker.py ``broadcast``): the sender gathers one bucket's parameters at a
    time, copies them into a stream buffer inside that gather and sends the copy, so at most one bucket of
    full parameters exists beside the partitions. A tensor the gather hands out is invalidated when its
    block ends (as ZeRO-3 releases the gathered storage): what arrives must still be the right bits."""
    w = eight_tensors(9)
    buckets = plan_buckets(specs_of(w), bucket_bytes=800)
    assert len(buckets) >= 3
    entered: list[int] = []

    @contextlib.contextmanager
    def gather(b):
        entered.append(buckets.index(b))
        full = {sp.name: w[sp.name].clone() for sp in b.specs}  # "gathered" for the block only
        yield full
        for t in full.values():
            t.fill_(float("nan")) if t.is_floating_point() else t.zero_()  # released: garbage afterwards

    def fn(r, g):
        if r == 0:
            g.send_weights(buckets, None, gather=gather)
            with pytest.raises(ValueError, match="exactly one"):
                g.send_weights(buckets, w, gather=gather)
            return dict(g.last_push)
        return {k: v.clone() for k, v in g.recv_weights(buckets).items()}

    out = run_ranks(2, fn)
    assert entered == list(range(len(buckets)))
    assert out[0]["in_place"] == 0  # nothing sent from a gathered tensor itself
    assert all(torch.equal(bits(out[1][k]), bits(v)) for k, v in w.items())
