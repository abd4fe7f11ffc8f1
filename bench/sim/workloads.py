"""The workloads the scheduler simulator runs (``scheduler_sim.Workload``), every figure with its source or
the word "assumed". BENCHMARKS ONLY.

- ``SHORT``: a Search-R1 / R1-Searcher-shaped job (about 2 searches over Wikipedia, short turns): the shape
  where the learner's share of GPU time is large and overlap has little to hide.
- ``LONG``: an ASearcher-shaped job (arXiv 2508.07976; inclusionAI/ASearcher): tens of web searches and
  page fetches of seconds each, contexts to 32k under a per-GPU KV budget: the heavy tail where async pays.
- ``validation_workload(setting)``: what the real-system run ``bench/results/async-vs-sync-vm-9e6c75151e.json``
  realised (its reference-7b label is not what ran: the tiny policy makes 1.3 searches, not 3-5 turns), for
  checking the simulator against it.

Shared hardware figures: the decode and prefill costs are ``gpu_cost.py``'s fits (Mistral-7B on one H100
under vLLM; 7.25e9 parameters); the learner runs ``6N`` FLOP per trained token for the update (Kaplan et
al. 2020, arXiv 2001.08361) plus ``2N`` for the old-logprob recompute (one extra forward, on in the presets;
``reference.learner_passes``), at 0.40 MFU of 989.4 TFLOPS (assumed, at the Llama 3 report's 38-43 % BF16
MFU on H100s, arXiv 2407.21783 Table 4; NVIDIA's H100 SXM datasheet for the peak, as ``reference.py``).

Pure module.
"""
from __future__ import annotations

import math

from sonar.bench.sim import reference as R
from sonar.bench.sim.scheduler_sim import Tool, Workload

PARAMS = R.MODEL_PARAMS
"""7.25e9: the model the cost models were fitted on (``gpu_cost.py``)."""
PUSH_GBPS = 35.7
"""GB/s of a bf16 weight hand-over, measured by this repository on one H100 (colocated CUDA-IPC hand-over,
``bench/results/gpu/``). A split layout's push crosses NCCL between GPUs instead; taken at the same rate
(assumed; veRL's checkpoint engine reports ~8.25 GB/s over 400 Gb/s IB across nodes, slower)."""
PUSH_S = 2 * PARAMS / (PUSH_GBPS * 1e9)
"""Seconds per weight push: 2 bytes x N over ``PUSH_GBPS`` (0.41 s for 7.25e9 parameters)."""
SWITCH_S = R.COLOCATED_SWITCH_S
"""Seconds per colocated step to switch the GPUs between generation and training (1.5, assumed in
``reference.py``: weights each way over PCIe plus the KV cache's release and re-allocation)."""
KV_BYTES_PER_TOKEN = 128 * 1024
"""Mistral-7B's KV cache per token: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes (``gpu_cost.py``)."""
KV_TOKENS_H100 = (80e9 * 0.9 - 2 * PARAMS - 4e9) / KV_BYTES_PER_TOKEN
"""Tokens of KV cache one 80 GB H100 holds under vLLM at ``gpu_memory_utilization`` 0.9 (vLLM's default)
after the bf16 weights and ~4 GB of activations and CUDA graphs (assumed): about 408k tokens."""


def lognormal_pmf(median: float, sigma: float, lo: int, hi: int) -> tuple[float, ...]:
    """P(k) for k = 0..hi of a lognormal (``median``, ``sigma``) rounded and clipped to [lo, hi]."""
    from statistics import NormalDist

    cdf, mu = NormalDist().cdf, math.log(median)

    def below(x: float) -> float:
        return 0.0 if x <= 0 else cdf((math.log(x) - mu) / sigma)

    p = [0.0] * (hi + 1)
    for k in range(lo, hi + 1):
        a = 0.0 if k == lo else below(k - 0.5)
        b = 1.0 if k == hi else below(k + 0.5)
        p[k] = b - a
    return tuple(p)


SHORT = Workload(
    name="short",
    # R1-Searcher's released traces: 2.0-2.2 searches per trajectory, p90 3, max 5 (as issue 52 reads
    # them); this pmf has mean 2.1, p90 3, max 5. Search-R1's train_grpo.sh caps turns at max_turns=2
    # (PeterGriffinJin/Search-R1, train_grpo.sh); R1-Searcher's traces go further, so theirs is used.
    calls_pmf=(0.03, 0.22, 0.42, 0.25, 0.06, 0.02),
    # Search-R1 train_grpo.sh: data.max_response_length=500 tokens per turn; the lognormal median 220,
    # sigma 0.5 is reference.py's (assumed), clipped at that 500.
    turn_median=R.TURN_MEDIAN_TOKENS, turn_sigma=R.TURN_SIGMA, turn_max=500,
    prompt_tokens=R.PROMPT_TOKENS,  # 600, assumed (reference.py)
    # retriever.topk=3 (Search-R1 train_grpo.sh) passages of 100 words (the DPR Wikipedia split): ~130 tokens
    # each (reference.py); latency: reference.py's assumed 40 ms median (sigma 0.5) + 3 ms per query.
    tools=(Tool("search", 1.0, R.RETRIEVAL_MEDIAN_MS, R.RETRIEVAL_SIGMA, R.PASSAGES_PER_SEARCH * R.PASSAGE_TOKENS),),
    retrieval_servers=0, retrieval_per_call_ms=R.RETRIEVAL_PER_QUERY_MS,
    # Search-R1 train_grpo.sh: data.max_prompt_length=4096 bounds the context the policy sees
    max_context=4096,
    params=PARAMS,
    # Search-R1 train_grpo.sh: n_agent=5; R1-Searcher samples more; Sonar's presets (configs/bench.yaml) 8: 8
    group_size=8,
    row_cap=64,  # configs/bench.yaml rollout.max_batch_rows (the rows one engine holds)
    kv_tokens=KV_TOKENS_H100,
    mfu=R.LEARNER_MFU, extra_forwards=1, push_s=PUSH_S, switch_s=SWITCH_S,
    note={"source": "Search-R1 train_grpo.sh (max_response_length 500, max_prompt_length 4096, topk 3, n_agent 5, "
                    "max_turns 2); R1-Searcher's traces (2.0-2.2 searches, p90 3, max 5); reference.py (turn lengths, "
                    "prompt, retrieval latency, learner); group size 8 from Sonar's presets"},
)
"""The short, Wikipedia-search job."""

LONG = Workload(
    name="long",
    # ASearcher (arXiv 2508.07976): over 40 tool calls for some trajectories; ASearcher/train/
    # asearcher_reasoning.py: max_turns=128 (default), force_turns=4. The distribution itself is assumed:
    # lognormal, median 12 calls, sigma 0.8 (p90 ~33, ~5 % over 40), at least 4, at most 127.
    calls_pmf=lognormal_pmf(12.0, 0.8, 4, 127),
    # per-turn reasoning of a reasoning model between calls: assumed median 500, sigma 0.7, at most 4,096
    turn_median=500.0, turn_sigma=0.7, turn_max=4096,
    prompt_tokens=1000,  # assumed: instructions, tool descriptions and the question
    # search: topk=10 (asearcher_reasoning.py) snippets of ~50 tokens; access: a web page's content, cut to
    # ~2k tokens (assumed). Latencies assumed: web search ~1.5 s, page fetch ~3 s ("seconds"; the paper's
    # online setting calls a commercial search API and fetches pages).
    tools=(Tool("search", 0.6, 1500.0, 0.6, 500), Tool("access", 0.4, 3000.0, 0.8, 2000)),
    retrieval_servers=0,
    # asearcher_reasoning.py: max_tokens=30000 of the episode; contexts to 32k (the paper)
    max_context=32768,
    params=PARAMS,
    group_size=8,  # assumed, as SHORT (the paper's GRPO group size was not checked)
    row_cap=64, kv_tokens=KV_TOKENS_H100,
    mfu=R.LEARNER_MFU, extra_forwards=1, push_s=PUSH_S, switch_s=SWITCH_S,
    note={"source": "ASearcher arXiv 2508.07976 (tool calls over 40, contexts to 32k); inclusionAI/ASearcher "
                    "ASearcher/train/asearcher_reasoning.py (max_turns 128, force_turns 4, topk 10, max_tokens "
                    "30000); the call distribution, turn lengths, tool latencies and returned tokens assumed"},
)
"""The long, web-agent job."""

WORKLOADS = {"short": SHORT, "long": LONG}

# ------------------------------------------------------------------------------------ validation
VALIDATION_RESULT = "async-vs-sync-vm-ac45a01df5.json"
"""The real-system run the simulator is checked against (reference-7b workload, 3 seeds, 8 RL steps; its
colocated baseline at the full batch the engines hold, its async setting on the production scheduler)."""
VALIDATION_HIDDEN_PER_TURN = R.hidden_tokens_per_turn()
"""249.1: the clipped lognormal's mean (median 220, sigma 0.5, at most 1,024) the paced engine drew per turn."""


def validation_workload(realised: dict) -> Workload:
    """The run's workload as it realised it, from its per-setting means (``realised``: ``searches_per_traj``,
    ``model_tokens_per_traj``, ``decode_row_steps_per_trained_traj``, ``ctx_admitted_mean``,
    ``zero_signal_share``, ``learner_tokens_per_traj``):

    - turns = searches + 1 + an extra turn with the chance that makes the row-steps per trajectory
      ((row-steps - real tokens) / 249.1 hidden tokens per turn); searches 1, 2 or 3 (a pmf with the realised
      mean: 0-search and 3-search trajectories assumed rare);
    - per turn: the tiny policy's real tokens (realised mean / turns) plus the paced engine's hidden tail
      (lognormal median 220, sigma 0.5, at most 1,024), which leaves the context with the turn;
    - contexts as the engines charged them: each tiny token 8 real (``sim.context_scale``); a search returns
      one passage, taken as 30 tiny tokens with the policy's turn (240 real, assumed) and the prompt is fitted
      so that the mean admitted context equals the realised ``ctx_admitted_mean``;
    - retrieval: 8 servers, lognormal 40 ms (sigma 0.5) + 3 ms per call; learner: the realised learner tokens
      per trained trajectory at 6N FLOP (one update pass and no extra forward: what ``learner_passes`` counts
      for the run's one-epoch, one-mini-batch GRPO, and what its hook charged) on the setting's GPUs at 0.40
      MFU; groups of the realised zero-signal share skipped; no push or switch cost beyond the colocated
      1.5 s (the run pushed the tiny model in milliseconds)."""
    searches = float(realised["searches_per_traj"])
    real_tokens = float(realised["model_tokens_per_traj"])
    turns = (float(realised["decode_row_steps_per_trained_traj"]) - real_tokens) / VALIDATION_HIDDEN_PER_TURN
    extra = min(1.0, max(0.0, turns - (searches + 1.0)))
    # searches in {1, 2, 3}: p1 + 2 p2 + 3 p3 = mean, with p3 = p2 / 8 (assumed: a short tail)
    p2 = max(0.0, (searches - 1.0) / (1.0 + 2.0 / 8.0))
    p3, p1 = p2 / 8.0, 1.0 - p2 - p2 / 8.0
    fixed = max(0, round(real_tokens / turns))
    per_search = 8 * 30
    # mean admitted context = prompt + per_search x E[sum over turns of the searches before it] / E[turns]
    e_turns = 1 * p1 + 2 * p2 + 3 * p3 + 1 + extra
    e_before = p1 * 1 + p2 * 3 + p3 * 6 + extra * searches
    prompt = max(8, round(float(realised["ctx_admitted_mean"]) - per_search * e_before / e_turns))
    return Workload(
        name="validation-" + VALIDATION_RESULT.rsplit("-", 1)[1].split(".")[0],
        calls_pmf=(0.0, p1, p2, p3), turn_median=R.TURN_MEDIAN_TOKENS, turn_sigma=R.TURN_SIGMA,
        turn_max=R.TURN_MAX_TOKENS, turn_fixed=fixed, extra_turn_p=extra, keep_generated=False,
        prompt_tokens=prompt, tools=(Tool("search", 1.0, R.RETRIEVAL_MEDIAN_MS, R.RETRIEVAL_SIGMA, per_search),),
        retrieval_servers=R.RETRIEVAL_SERVERS, retrieval_per_call_ms=R.RETRIEVAL_PER_QUERY_MS,
        max_context=1 << 20, params=PARAMS, group_size=8, row_cap=64, kv_tokens=math.inf,
        mfu=R.LEARNER_MFU, extra_forwards=0, learner_tokens_per_traj=float(realised["learner_tokens_per_traj"]),
        zero_signal_share=float(realised["zero_signal_share"]), push_s=0.0, switch_s=R.COLOCATED_SWITCH_S,
        note={"realised": dict(realised), "turns": turns, "searches_pmf": [p1, p2, p3], "extra_turn_p": extra,
              "turn_fixed_tokens": fixed, "prompt_tokens": prompt})
