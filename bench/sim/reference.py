"""The reference workload: what one search-RL step of a 7B policy on H100s costs, in one file. BENCHMARKS ONLY.

The CPU benchmarks train the real tiny policy with the real system, and simulate around it what a real
job would spend (``sim:`` settings, ``bench/sim/``). This module states the real job they stand for,
with each number's source or, where none was found, the word "assumed", and turns it into the
``sim.*`` and production overrides ``sonar bench async-vs-sync --workload reference-7b`` applies
(``overrides()``). A result names the workload it ran (``label()``).

The job (R1-Searcher / Search-R1 shaped: GRPO, groups of 8, a think-search-answer loop):

- **Policy and hardware.** A 7B model: the decode and prefill cost models are Mistral-7B-Instruct-v0.3
  (7.25e9 parameters) on one H100-80GB-SXM under vLLM, fitted to published per-request timings
  (``gpu_cost.py``: SOURCE). One rollout worker is one such GPU.
- **Turns and lengths.** 3-5 turns per trajectory; each turn generates 100-500 tokens with a long
  tail: lognormal, median 220, sigma 0.5 (5th-95th percentile 97-501 tokens), clipped at 1,024
  (assumed, shaped as the issue's brief). These are simulated tokens that hold an engine slot
  (``paced_engine.py``); the tiny policy's own tokens are what is trained and rewarded.
- **Contexts.** A real context grows to 2-4k tokens over the turns: a ~600-token prompt (instructions
  and question, assumed) plus, per search, 3 passages of 100 words (the DPR Wikipedia split used by
  Search-R1 and R1-Searcher: 21M passages of 100 words; ~130 tokens each, ~390 per search) and the
  turn's generation (~220): 600 + 610 x turns = 2.4k at 3 turns, 3.7k at 5. The tiny world's contexts
  end at ~300-500 tokens (``configs/bench.yaml``: up to 512 in all, 96-token documents), so every real
  context token counts ``CONTEXT_SCALE`` = 8 in the cost models (2.4-4k); the engines report the
  contexts they charged (``ctx_admitted_mean``), which is how a result shows the scale it reached.
- **Prefill and swaps.** Every admitted prompt is prefilled at the fitted cost (no prefix caching:
  each turn's whole context), and every weight swap with rows in flight recomputes their KV cache
  (``gpu_cost.Prefill7BCost``).
- **Retrieval.** A search cluster of ``RETRIEVAL_SERVERS`` servers answering a batched request in a
  lognormal time (median 40 ms, sigma 0.5) plus 3 ms per query in it; requests beyond the servers
  queue. Assumed: no published latency of BM25 on Elasticsearch or e5 + FAISS over the 21M-passage
  index was found. Measured here on 200k passages (``bench/results/retrieval-vm-1564537c02.json``):
  BM25 848 single queries/s on 2 vCPUs and 0.67 ms of Elasticsearch protocol per call, so a 21M-passage
  index (105x larger) with a dense rerank is taken as tens of milliseconds per request.
- **Layout.** ``ROLLOUT_GPUS`` rollout workers (one GPU each) and ``LEARNER_GPUS`` learner GPUs; the
  colocated baseline runs both on all of them and pays ``COLOCATED_SWITCH_S`` per step (assumed).
- **Learner.** ``LEARNER_GPUS`` H100s train ``8 x N`` FLOP per trained token (6N for the update,
  Kaplan et al. 2020, arXiv 2001.08361; 2N for the old-policy logprob forward) at ``LEARNER_MFU`` of the
  dense BF16 peak (989.4 TFLOPS, NVIDIA's H100 SXM datasheet). 0.40 is assumed, at the Llama 3 report's
  38-43 % BF16 MFU on H100s (arXiv 2407.21783, Table 4); RL learners usually reach less. Each trained
  trajectory is ``TOKENS_PER_TRAJ`` tokens (the mean real context at the end of a trajectory, 4 turns).
  The time is charged before the weights go out (``hooks.LearnerTime``).

Pure module: no torch, no Ray.
"""
from __future__ import annotations

import math

MODEL_PARAMS = 7.25e9
"""Parameters of the model the cost models were fitted on (Mistral-7B-Instruct-v0.3)."""
PEAK_BF16_FLOPS = 989.4e12
"""H100 SXM dense BF16 tensor-core peak, FLOP/s (NVIDIA H100 datasheet; 1,979 TFLOPS with sparsity)."""
FLOPS_PER_TRAINED_TOKEN = 8.0 * MODEL_PARAMS
"""6N (forward and backward of the update, Kaplan et al. 2020) + 2N (the old-policy logprob forward)."""
LEARNER_MFU = 0.40
"""Assumed model-FLOPs utilisation of the learner (the Llama 3 report: 38-43 % on H100s, pre-training)."""
LEARNER_GPUS = 2
"""GPUs of the simulated learner (assumed: 2 of 6, the 2:1 rollout-to-training split of disaggregated runs)."""

TURNS = (3, 5)
"""Turns per trajectory (min, max)."""
TURN_MEDIAN_TOKENS = 220.0
TURN_SIGMA = 0.5
TURN_MAX_TOKENS = 1024
PROMPT_TOKENS = 600
"""Instructions and question (assumed)."""
PASSAGES_PER_SEARCH = 3
PASSAGE_TOKENS = 130
"""A 100-word Wikipedia passage (the DPR split), at ~1.3 tokens per word."""
CONTEXT_SCALE = 8.0
"""Real context tokens per tiny-world context token (the tiny world's contexts end at ~300-500)."""
RETRIEVAL_MEDIAN_MS = 40.0
RETRIEVAL_SIGMA = 0.5
RETRIEVAL_PER_QUERY_MS = 3.0
RETRIEVAL_SERVERS = 8
ROLLOUT_GPUS = 4
"""Rollout workers of the disaggregated layout, one GPU each (with ``LEARNER_GPUS``: 6 GPUs in all, 2:1)."""
COLOCATED_SWITCH_S = 1.5
"""Assumed seconds per step to switch the GPUs between generation and training in the colocated layout:
14.5 GB of bf16 weights moved each way over PCIe (~0.6 s each at ~25 GB/s achieved) plus the engine's
KV-cache release and re-allocation."""


def context_after(turns: int) -> float:
    """Real context tokens at the end of a trajectory of ``turns`` turns (each one generation and one search)."""
    per_turn = TURN_MEDIAN_TOKENS + PASSAGES_PER_SEARCH * PASSAGE_TOKENS
    return PROMPT_TOKENS + per_turn * turns


TOKENS_PER_TRAJ = context_after(4)
"""Tokens the learner trains per trajectory: the context at the end of a 4-turn trajectory (3,040)."""


def turn_tokens_quantile(q: float) -> float:
    """The ``q`` quantile of the per-turn generation length (lognormal, before the clip)."""
    from statistics import NormalDist

    return TURN_MEDIAN_TOKENS * math.exp(TURN_SIGMA * NormalDist().inv_cdf(q))


def learner_tokens_per_s(gpus: int = LEARNER_GPUS, mfu: float = LEARNER_MFU) -> float:
    """Trained tokens per second of the simulated learner on ``gpus`` GPUs at ``mfu``."""
    if gpus < 1 or not (0 < mfu <= 1):
        raise ValueError(f"gpus={gpus} must be >= 1 and mfu={mfu} in (0, 1]")
    return gpus * mfu * PEAK_BF16_FLOPS / FLOPS_PER_TRAINED_TOKEN


def overrides() -> list[str]:
    """The ``sim.*`` and production overrides of the reference workload, on top of ``configs/bench.yaml``."""
    return [
        "sim.decode_cost=gpu_7b", "sim.prefill_cost=gpu_7b", f"sim.context_scale={CONTEXT_SCALE}",
        f"sim.decode_median_tokens={TURN_MEDIAN_TOKENS}", f"sim.decode_sigma={TURN_SIGMA}",
        f"sim.decode_max_tokens={TURN_MAX_TOKENS}",
        f"sim.retrieval_latency_ms={RETRIEVAL_MEDIAN_MS}", f"sim.retrieval_latency_sigma={RETRIEVAL_SIGMA}",
        f"sim.retrieval_per_query_ms={RETRIEVAL_PER_QUERY_MS}", f"sim.retrieval_servers={RETRIEVAL_SERVERS}",
        "sim.learner_cost=flops_7b", f"sim.learner_gpus={LEARNER_GPUS}", f"sim.learner_mfu={LEARNER_MFU}",
        f"sim.learner_tokens_per_traj={TOKENS_PER_TRAJ}", f"sim.colocated_switch_s={COLOCATED_SWITCH_S}",
        f"protocol.max_turns={TURNS[1]}", f"rollout.num_workers={ROLLOUT_GPUS}",
    ]


def label() -> dict:
    """What a result that ran this workload records about it."""
    return {"workload": "reference-7b", "model": "Mistral-7B-Instruct-v0.3 cost models (bench/sim/gpu_cost.py)",
            "turns": list(TURNS), "turn_tokens": {"median": TURN_MEDIAN_TOKENS, "sigma": TURN_SIGMA,
                                                  "p5": turn_tokens_quantile(0.05), "p95": turn_tokens_quantile(0.95),
                                                  "max": TURN_MAX_TOKENS},
            "context_tokens": {str(t): context_after(t) for t in range(TURNS[0], TURNS[1] + 1)},
            "context_scale": CONTEXT_SCALE,
            "retrieval": {"median_ms": RETRIEVAL_MEDIAN_MS, "sigma": RETRIEVAL_SIGMA,
                          "per_query_ms": RETRIEVAL_PER_QUERY_MS, "servers": RETRIEVAL_SERVERS, "source": "assumed"},
            "rollout_gpus": ROLLOUT_GPUS, "colocated_switch_s": COLOCATED_SWITCH_S,
            "learner": {"gpus": LEARNER_GPUS, "mfu": LEARNER_MFU, "flops_per_token": FLOPS_PER_TRAINED_TOKEN,
                        "tokens_per_traj": TOKENS_PER_TRAJ, "tokens_per_s": learner_tokens_per_s(),
                        "tokens_per_s_per_gpu": learner_tokens_per_s(1)},
            "overrides": overrides()}
