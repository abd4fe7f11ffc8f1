"""A decode-step cost model of a 7B model on one GPU under vLLM, fitted to published measurements. BENCHMARKS ONLY.

``t(rows, ctx) = T0_MS + MS_PER_ROW * rows + MS_PER_1K_CTX * ctx / 1000`` (ms per decode step), where
``rows`` are the sequences in the step's batch and ``ctx`` the sum of their context lengths (prompt +
tokens so far). Why this form: a decode step of a 7B model is memory-bound; it reads the weights once
(``T0_MS``: 14.5 GB of bf16 weights), does a little work per row (``MS_PER_ROW``) and reads every row's
KV cache (``MS_PER_1K_CTX``: Mistral-7B holds 128 KiB of KV per token, 32 layers x 8 KV heads x 128 x
2 x bf16).

**Source** (one, read whole, nothing invented): LambdaLabsML/vllm-benchmark, the raw
``benchmark_serving.py`` result files of ``mistralai/Mistral-7B-Instruct-v0.3`` on one H100-80GB-SXM
under vLLM (``vllm/vllm-openai`` docker image, 2024-09-07; ShareGPT prompts, request rate inf, so all
prompts arrive at once; max-num-seqs 256):

- ``results/prompt_10/1xH100-80GB-SXM/Mistral-7B-Instruct-v0.3_tp1_len2048.json`` (10 prompts)
- ``results/prompt_80/1xH100-80GB-SXM/Mistral-7B-Instruct-v0.3_tp1_len2048.json`` (80 prompts)

(https://github.com/LambdaLabsML/vllm-benchmark, commit a4f9f4371a1ccac781293837fce2bce0cc6d25cc; its
``benchmark_v0.md`` is the write-up.) Each file holds every request's ``input_lens``, ``output_lens``
and streamed inter-token latencies (``itls``). What was read off it, and how (``published_points``):

- The server ran multi-step scheduling: every streamed chunk carries 10 tokens (a request of ``n``
  output tokens has exactly ``ceil((n - 1) / 10)`` ITL entries in every request checked: all 10 of the
  10-prompt file and the 22 whose lists open the 80-prompt file), so
  one ITL entry is 10 decode steps of the whole batch and ``ms per step = ITL / 10``.
- All requests share chunk boundaries (their ITL lists agree entry by entry to ~0.1 ms), so the
  chunk durations are taken from the longest request that starts with the others (request index 5,
  928 tokens, 93 chunks; ``TIMING_ITL_MS``), and the rows in chunk ``j`` are the requests with more
  than ``j`` chunks. The row's context in chunk ``j`` is ``input_len + 1 + 10 j + 5`` (mid-chunk).
- The 10-prompt file: every prompt is prefilled before the first chunk (all TTFTs are 68 ms), so every
  chunk is pure decode. The 80-prompt file: prefills run until 0.78 s, inside chunk 0, which is
  dropped; after that the row counts are exact up to +-1 chunk of alignment (prompts were admitted
  in 13 prefill batches between 0.26 and 0.78 s). The last chunk of the timing request is partial and
  dropped.

That gives 183 (rows, ctx, ms) points: rows 1-64, ctx 443-16,695 tokens, 6.74-8.50 ms. Least squares
(``fit``) gives the shipped coefficients; residuals: rms 0.074 ms, max 0.235 ms (the first decode
chunk of the 80-prompt run, 64 rows, which may still hold a late prefill). ``tests/bench/
test_gpu_cost.py`` re-derives the points and re-fits.

**Prefill** (``Prefill7BCost``, fitted to the same file's TTFTs: ``prefill_points``) is a separate model;
the decode model alone charges a row's prompt as context only. **What the decode model ignores:** preemption and
swapping when the KV cache fills, CUDA-graph batch-size buckets (the measured ITLs step at bucket
sizes; the line smooths them), sampling and detokenisation overheads beyond what the ITLs include
(they are measured at the HTTP client, so they include streaming), and any GPU other than an H100
SXM. Outside rows 1-64 and ctx 443-16,695 it extrapolates linearly. The measurements are of Mistral-7B;
no published per-step figures for a Llama/Qwen 7B with this resolution were found (the vLLM nightly
latency test gives one aggregate point for Llama-3.1-8B on an H200: batch 8, 32 in / 128 out, 833 ms
per request, i.e. <= 6.5 ms per step including prefill; buildkite.com/vllm/performance-benchmark/
builds/9515 -- consistent with this model's 6.7 ms at 8 rows, not used in the fit: another GPU).

Pure module: numpy and the standard library.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

SOURCE = {
    "title": "LambdaLabsML/vllm-benchmark: benchmark_serving.py results, Mistral-7B-Instruct-v0.3 on 1x H100-80GB-SXM "
             "(vllm-openai image, 2024-09-07, ShareGPT, request rate inf)",
    "url": "https://github.com/LambdaLabsML/vllm-benchmark",
    "commit": "a4f9f4371a1ccac781293837fce2bce0cc6d25cc",
    "files": ["results/prompt_10/1xH100-80GB-SXM/Mistral-7B-Instruct-v0.3_tp1_len2048.json",
              "results/prompt_80/1xH100-80GB-SXM/Mistral-7B-Instruct-v0.3_tp1_len2048.json"],
    "read": "per-request input_lens, output_lens and streamed ITLs; one ITL entry = 10 decode steps "
            "(multi-step scheduling); rows per chunk from the output lengths (see bench/sim/gpu_cost.py)",
}
MODEL = "Mistral-7B-Instruct-v0.3 (7.2B, bf16) on one H100-80GB-SXM under vLLM, request-level continuous batching"
TOKENS_PER_CHUNK = 10
"""Decode steps per streamed ITL entry (the server's multi-step scheduling; checked by the test)."""


@dataclass(frozen=True)
class Run:
    """One published result file, the parts the points are derived from."""

    file: str
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    timing_request: int
    """The request whose ITL list gives the chunk durations (the longest one that started with the rest)."""
    timing_itl_ms: tuple[float, ...]
    """Its ITLs in ms, rounded to 0.01 ms, in order."""
    first_clean_chunk: int
    """Chunks before this one hold prefills (0: none do)."""


RUNS = (
    Run(file=SOURCE["files"][0],
        input_lens=(14, 30, 28, 12, 375, 29, 487, 369, 5, 236),
        output_lens=(129, 883, 273, 169, 0, 928, 10, 26, 8, 57),
        timing_request=5, first_clean_chunk=0, timing_itl_ms=(
        70.86, 69.51, 69.36, 68.86, 69.02, 68.96, 67.54, 67.77, 67.87, 67.98, 68.16, 68.66, 69.63, 68.47, 69.06,
        68.92, 69.40, 68.17, 68.23, 68.19, 68.28, 68.34, 68.27, 68.65, 68.31, 68.37, 68.42, 69.13, 67.58, 67.61,
        67.71, 68.10, 67.58, 67.69, 67.70, 67.60, 67.68, 67.69, 67.76, 67.61, 67.66, 67.64, 67.69, 67.89, 67.79,
        67.65, 68.20, 67.56, 67.74, 67.68, 67.71, 67.71, 67.78, 67.81, 67.71, 67.76, 67.78, 68.01, 67.80, 68.25,
        67.43, 67.64, 68.19, 67.84, 67.66, 67.76, 68.50, 67.53, 67.92, 68.01, 67.71, 67.91, 67.84, 67.91, 67.82,
        67.84, 67.81, 67.88, 67.81, 67.87, 67.89, 68.05, 67.94, 67.80, 67.84, 68.13, 67.86, 68.44, 67.95, 67.51,
        67.66, 67.64, 65.90)),
    Run(file=SOURCE["files"][1],
        input_lens=(
        14, 30, 28, 12, 375, 29, 487, 369, 5, 236, 4, 18, 494, 518, 10, 14, 277, 8, 17, 493, 776, 64, 87, 879,
        776, 341, 455, 9, 12, 48, 12, 5, 88, 865, 386, 42, 716, 9, 323, 18, 19, 837, 725, 13, 10, 312, 13, 153,
        569, 921, 431, 7, 391, 9, 53, 300, 958, 577, 99, 759, 22, 16, 18, 84, 33, 196, 11, 722, 559, 46, 391,
        24, 569, 838, 123, 121, 457, 91, 588, 299),
        output_lens=(
        129, 883, 273, 184, 0, 928, 10, 26, 8, 57, 10, 504, 95, 493, 49, 322, 157, 302, 409, 47, 748, 326, 168,
        105, 39, 49, 571, 132, 251, 7, 8, 169, 63, 14, 814, 231, 20, 135, 0, 260, 219, 18, 39, 314, 225, 562,
        281, 120, 28, 235, 19, 233, 11, 224, 92, 240, 0, 11, 143, 7, 664, 5, 343, 28, 344, 185, 46, 26, 0, 183,
        0, 27, 301, 11, 14, 1028, 76, 819, 13, 0),
        timing_request=5, first_clean_chunk=1, timing_itl_ms=(
        429.13, 84.98, 80.51, 79.52, 79.50, 78.68, 79.68, 77.94, 79.18, 79.31, 78.16, 79.05, 79.42, 78.55,
        78.90, 78.86, 78.63, 78.98, 77.87, 78.14, 79.47, 77.77, 78.10, 78.77, 75.91, 75.79, 75.80, 75.60, 75.49,
        75.32, 75.13, 76.00, 74.27, 75.94, 75.83, 75.06, 75.16, 75.24, 74.94, 75.22, 75.10, 75.18, 75.67, 74.97,
        75.51, 75.65, 75.81, 77.04, 75.54, 75.59, 74.68, 74.69, 74.73, 74.67, 74.61, 75.13, 75.67, 71.64, 71.83,
        71.62, 71.84, 72.19, 71.62, 71.69, 71.75, 71.69, 71.66, 71.56, 71.61, 71.67, 71.52, 71.75, 71.93, 72.17,
        71.66, 71.17, 71.47, 71.40, 71.25, 71.50, 72.07, 71.70, 69.28, 69.21, 69.31, 69.39, 69.24, 69.32, 70.15,
        67.65, 68.03, 68.06, 65.99)),
)
"""The two published runs, as read (ITLs rounded to 0.01 ms)."""

T0_MS = 6.6955
"""Fitted: ms per decode step with no rows and no context (the weight read and fixed overheads)."""
MS_PER_ROW = 0.0043
"""Fitted: ms per row in the batch."""
MS_PER_1K_CTX = 0.0923
"""Fitted: ms per 1,000 context tokens summed over the batch's rows (the KV-cache read)."""
FIT_RMS_MS = 0.074
"""Root-mean-square residual of the fit over the published points, in ms."""
FIT_MAX_ABS_MS = 0.235
"""Largest absolute residual of the fit over the published points, in ms."""


def chunks_of(output_len: int) -> int:
    """ITL entries of a request with ``output_len`` tokens (the first token comes with the TTFT)."""
    return 0 if output_len <= 0 else math.ceil((output_len - 1) / TOKENS_PER_CHUNK)


def published_points(runs: Sequence[Run] = RUNS) -> np.ndarray:
    """``[n, 3]`` array of (rows, ctx tokens, ms per step) derived from the published runs (module docstring).

    With :func:`fit`, the derivation of the shipped coefficients: nothing at run time calls them (the
    simulator reads the constants), they are kept so the constants can be re-derived and a test checks
    that the shipped ones are this fit."""
    out = []
    for run in runs:
        n = [chunks_of(o) for o in run.output_lens]
        itl = run.timing_itl_ms
        if len(itl) != n[run.timing_request]:
            raise ValueError(f"{run.file}: timing request has {len(itl)} ITLs, its output length says "
                             f"{n[run.timing_request]}")
        for j in range(run.first_clean_chunk, len(itl) - 1):  # the timing request's last chunk is partial
            live = [r for r, k in enumerate(n) if k > j]
            ctx = sum(run.input_lens[r] + 1 + TOKENS_PER_CHUNK * j + TOKENS_PER_CHUNK // 2 for r in live)
            out.append((len(live), ctx, itl[j] / TOKENS_PER_CHUNK))
    return np.asarray(out, dtype=np.float64)


def fit(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares of ``ms ~ t0 + a rows + b ctx/1000``: ((t0, a, b), residuals)."""
    X = np.column_stack([np.ones(len(points)), points[:, 0], points[:, 1] / 1000.0])
    coef, *_ = np.linalg.lstsq(X, points[:, 2], rcond=None)
    return coef, points[:, 2] - X @ coef


# ------------------------------------------------------------------------------------ prefill
PREFILL_TTFT_MS = (
        461.8, 461.6, 461.5, 461.5, 0.0, 461.2, 498.7, 498.7, 498.6, 498.6, 546.8, 498.3,
        498.3, 546.3, 546.4, 546.2, 546.6, 546.2, 546.2, 545.8, 592.4, 545.8, 592.2, 592.2,
        644.9, 644.6, 644.5, 692.6, 692.4, 644.3, 644.3, 644.2, 644.2, 691.7, 691.7, 692.1,
        692.0, 262.1, 0.0, 261.9, 262.0, 261.7, 308.3, 261.7, 261.4, 261.6, 261.5, 307.7,
        307.7, 359.2, 359.2, 724.2, 724.1, 724.1, 775.3, 723.9, 0.0, 774.6, 774.5, 774.6,
        407.8, 774.2, 357.7, 357.7, 357.7, 357.7, 357.6, 406.8, 0.0, 406.9, 0.0, 406.5,
        406.3, 451.8, 451.7, 772.8, 777.7, 777.6, 777.6, 0.0)
"""The 80-prompt file's ``ttfts`` (time to first token per request, s in the file), in ms rounded to 0.1;
0.0 where the file says 0 (the six requests with no output, excluded). All requests were sent at once."""
PREFILL_GAP_MS = 3.0
"""Requests whose first tokens came within this of the previous one's were prefilled in the same batch."""
PREFILL_T0_MS = 21.28
"""Fitted: ms per prefill batch with no tokens (scheduling, sampling and the batch's fixed costs)."""
PREFILL_MS_PER_1K = 14.81
"""Fitted: ms per 1,000 prompt tokens prefilled. It equals the FLOP floor of an H100 SXM (2 x 7.25e9 FLOP
per token at 989 TFLOPS bf16 dense: 14.7 ms per 1k), so the fit reads as "the batch's tokens at peak
FLOPs, plus 21 ms per batch"; the 11 batches of 700-2,800 tokens hardly separate the two (per batch,
19-35 ms per 1k tokens on average), the 12th has 113 tokens."""
PREFILL_FIT_RMS_MS = 6.74
"""Root-mean-square residual of the prefill fit over its 12 batches, in ms."""


def prefill_points(run: Run = RUNS[1], ttft_ms: Sequence[float] = PREFILL_TTFT_MS) -> np.ndarray:
    """``[n, 2]`` array of (prompt tokens in a prefill batch, ms the batch took) read off the published
    80-prompt run, where every request was sent at once and prefills ran back to back until 0.78 s
    (the module docstring): requests sorted by TTFT form one batch while each comes within
    ``PREFILL_GAP_MS`` of the previous one; a batch's time is its last TTFT minus the previous batch's.
    The first batch (its TTFT also holds the run's start, 262 ms) is dropped."""
    reqs = sorted((t, i) for i, t in enumerate(ttft_ms) if t > 0)
    groups: list[list[tuple[float, int]]] = []
    for t, i in reqs:
        if groups and t - groups[-1][-1][0] < PREFILL_GAP_MS:
            groups[-1].append((t, i))
        else:
            groups.append([(t, i)])
    out, prev = [], None
    for g in groups:
        end = g[-1][0]
        if prev is not None:
            out.append((sum(run.input_lens[i] for _, i in g), end - prev))
        prev = end
    return np.asarray(out, dtype=np.float64)


def fit_prefill(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares of ``ms ~ t0 + c tokens/1000``: ((t0, c), residuals)."""
    X = np.column_stack([np.ones(len(points)), points[:, 0] / 1000.0])
    coef, *_ = np.linalg.lstsq(X, points[:, 1], rcond=None)
    return coef, points[:, 1] - X @ coef


class Prefill7BCost:
    """``t(tokens) = t0 + c tokens / 1000`` ms for one prefill of ``tokens`` prompt tokens (0 for none),
    fitted to the same published run as the decode model (``prefill_points``). The simulators charge it
    for the prompts a step admits and for the KV recompute of the rows in flight after a weight swap."""

    name = "gpu_7b_prefill"

    def __init__(self, t0_ms: float = PREFILL_T0_MS, ms_per_1k: float = PREFILL_MS_PER_1K):
        self.t0_ms, self.ms_per_1k = float(t0_ms), float(ms_per_1k)

    def __call__(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else self.t0_ms + self.ms_per_1k * tokens / 1000.0

    def label(self) -> dict:
        (t0, c), res = fit_prefill(prefill_points())  # re-derived from the published run, beside the shipped ones
        return {"refit": {"t0_ms": float(t0), "ms_per_1k_tokens": float(c),
                          "rms_ms": float(np.sqrt(np.mean(res ** 2)))},
                "prefill_cost": self.name, "form": "t = t0 + c*tokens/1000 ms per prefill (and per KV recompute)",
                "t0_ms": self.t0_ms, "ms_per_1k_tokens": self.ms_per_1k, "fit_rms_ms": PREFILL_FIT_RMS_MS,
                "fit_range": "prefill batches of 113-2,761 tokens", "model": MODEL, "source": dict(SOURCE),
                "read": "TTFTs of the 80-prompt file: requests prefilled together share a TTFT (within 3 ms); "
                        "a batch's time is the step between consecutive batches' TTFTs"}


# ------------------------------------------------------------------------------------ cost models
COSTS = ("flat", "gpu_7b")


class FlatCost:
    """Every decode step costs ``step_ms`` whatever the batch (the simulators' original model)."""

    name = "flat"

    def __init__(self, step_ms: float):
        if not (math.isfinite(step_ms) and step_ms > 0):
            raise ValueError(f"step_ms={step_ms} must be a finite number > 0 (sim.decode_ms_per_token)")
        self.step_ms = float(step_ms)

    def __call__(self, rows: int, ctx_tokens: int) -> float:
        return self.step_ms

    def label(self) -> dict:
        return {"decode_cost": "flat", "form": "t = step_ms per decode step, whatever the batch",
                "step_ms": self.step_ms, "source": "assumed (no measurement)"}


class Gpu7BCost:
    """``t(rows, ctx) = t0 + a rows + b ctx / 1000`` ms, fitted to published vLLM measurements (module docstring)."""

    name = "gpu_7b"

    def __init__(self, t0_ms: float = T0_MS, ms_per_row: float = MS_PER_ROW, ms_per_1k_ctx: float = MS_PER_1K_CTX):
        self.t0_ms, self.ms_per_row, self.ms_per_1k_ctx = float(t0_ms), float(ms_per_row), float(ms_per_1k_ctx)

    def __call__(self, rows: int, ctx_tokens: int) -> float:
        if rows <= 0:
            return 0.0
        return self.t0_ms + self.ms_per_row * rows + self.ms_per_1k_ctx * ctx_tokens / 1000.0

    def label(self) -> dict:
        return {"decode_cost": "gpu_7b", "form": "t = t0 + a*rows + b*sum(ctx)/1000 ms per decode step",
                "t0_ms": self.t0_ms, "ms_per_row": self.ms_per_row, "ms_per_1k_ctx": self.ms_per_1k_ctx,
                "model": MODEL, "fit_rms_ms": FIT_RMS_MS, "fit_max_abs_ms": FIT_MAX_ABS_MS,
                "fit_range": "rows 1-64, ctx 443-16,695 tokens", "source": dict(SOURCE),
                "ignores": "prefill compute, chunked prefill, preemption, CUDA-graph buckets"}


def make_cost(sim: Any) -> Callable[[int, int], float] | None:
    """The decode cost a ``SimConfig`` asks for: ``Gpu7BCost`` for ``decode_cost=gpu_7b``, ``FlatCost`` for
    ``flat`` with ``decode_ms_per_token`` > 0, None when decode time is not simulated."""
    kind = getattr(sim, "decode_cost", "flat")
    if kind == "gpu_7b":
        return Gpu7BCost()
    if kind != "flat":
        raise ValueError(f"sim.decode_cost={kind!r} is not one of {list(COSTS)}")
    return FlatCost(sim.decode_ms_per_token) if sim.decode_ms_per_token > 0 else None


def sim_cost_label(sim: Any) -> dict:
    """What produced a result's decode times, for its JSON: the cost model's name, parameters and
    citation, plus the simulated reasoning tail; or the engine's own decode time when nothing is simulated."""
    if getattr(sim, "engine", "real") == "bench":
        return {"decode_cost": "bench_engine", "form": "BenchEngine sleeps token_ms per token of a call's longest row",
                "token_ms": sim.token_ms, "source": "assumed (no measurement)"}
    cost = make_cost(sim)
    if cost is None:
        return {"decode_cost": "real", "form": "the engine's own decode time on this machine, nothing simulated"}
    out = cost.label()
    out["tail"] = {"median_tokens": sim.decode_median_tokens, "sigma": sim.decode_sigma,
                   "max_tokens": sim.decode_max_tokens}
    return out
