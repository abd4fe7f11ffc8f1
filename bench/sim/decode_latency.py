"""``DecodeLatencyEngine``: a BENCHMARK wrapper that gives a real engine the decode time of a long-tailed policy.

Why: the CPU policy (0.5M parameters) emits 10-20 tokens per turn in about a millisecond each, so its
generation lengths are short and nearly uniform. A real search agent (a 3-8B model) thinks for tens
to hundreds of tokens per turn with a long right tail, at 5-20 ms per decode step on an accelerator,
and the long tail is exactly what lockstep RL waits for. The async-vs-sync benchmark needs that
profile while still training the real policy (same tokens, logprobs, rewards and learning as
without the wrapper), so this wrapper charges *time*, not tokens:

- every row of every ``generate`` call (one turn of one trajectory) draws a reasoning length
  ``L ~ lognormal(ln median_tokens, sigma)``, clipped to ``[1, max_tokens]`` (the turn budget a real
  model would hit);
- the call then sleeps ``ms_per_token * max(L over rows)``: rows of one call decode together (one
  batched decode step per token) and a call returns when its longest row is done (a static batch,
  which is what Sonar's engines run: ``HFEngine`` and the offline ``VLLMEngine`` both serialise
  calls);
- the sleep happens inside this wrapper's lock, after the inner call, so concurrent calls of one
  worker (``rollout.batches_in_flight`` lanes) queue for the "device" exactly as they queue for the
  real engine, and ``load_weights`` waits for the call to end, simulated part included; the
  Generation keeps the version it was sampled with, so its policy lag on arrival includes the
  simulated decode time (the conservative choice).

Knobs (``sim.decode_*``, wired in by ``hooks.SimEngineWrap`` through the production engine hook):
``ms_per_token`` (``sim.decode_ms_per_token``; 0: no wrapper), ``median_tokens``, ``sigma``,
``max_tokens``. With the bench.yaml values
(10 ms, median 16, sigma 0.7, max 256) one row's turn is 160 ms at the median, p99 ~ 810 ms, and a
16-row call waits ~550 ms for its longest row. The hidden reasoning tokens are not trained: the
learner's cost is that of the visible tokens.

With ``cost`` (``sim.decode_cost=gpu_7b``: ``gpu_cost.Gpu7BCost``) a call instead sleeps
``sum over k = 1..max(L) of cost(rows with L >= k, sum over them of (prompt + visible tokens + k))``:
step k decodes the rows still reasoning, each with its context so far (``static_sleep_ms``).

Static engines only: for ``ContinuousHFEngine`` (``rollout.continuous_batching``) the same knobs drive
``paced_engine.PacedContinuousHFEngine``, where the simulated tokens hold batch slots.

Pure module: numpy and the standard library.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Sequence

import numpy as np

from sonar.actors.engine import Engine, Generation, SamplingParams


class ReasoningLengths:
    """Simulated reasoning tokens per turn: ``lognormal(ln median_tokens, sigma)``, rounded and clipped to
    ``[1, max_tokens]``; shared by this wrapper and the paced continuous engine."""

    def __init__(self, median_tokens: float, sigma: float, max_tokens: int, seed: int = 0):
        if not math.isfinite(median_tokens) or median_tokens < 1:
            raise ValueError(f"median_tokens={median_tokens} must be >= 1 (sim.decode_median_tokens)")
        if not math.isfinite(sigma) or sigma < 0:
            raise ValueError(f"sigma={sigma} must be a finite number >= 0 (sim.decode_sigma)")
        if max_tokens < median_tokens:
            raise ValueError(f"max_tokens={max_tokens} must be >= median_tokens={median_tokens} "
                             "(sim.decode_max_tokens)")
        self.median_tokens, self.sigma, self.max_tokens = float(median_tokens), float(sigma), int(max_tokens)
        self._rng = np.random.default_rng(abs(int(seed)))

    def draw(self, n: int) -> np.ndarray:
        """n lengths (int64)."""
        x = self._rng.lognormal(math.log(self.median_tokens), self.sigma, size=n)
        return np.clip(np.rint(x), 1, self.max_tokens).astype(np.int64)


def static_sleep_ms(cost, ctx: Sequence[int], lengths: Sequence[int]) -> float:
    """Decode time of one static batch: rows with contexts ``ctx`` reason ``lengths`` more tokens each,
    decoding together; step k (1..max length) costs ``cost(rows with length >= k, sum of their ctx + k)``."""
    ctx_a, len_a = np.asarray(ctx, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    total = 0.0
    for k in range(1, int(len_a.max(initial=0)) + 1):
        alive = len_a >= k
        n = int(alive.sum())
        total += cost(n, int(ctx_a[alive].sum()) + n * k)
    return total


class DecodeLatencyEngine:
    """An ``Engine`` that delegates to ``inner`` and then sleeps the decode time of long-tailed turns.

    ``ms_per_token`` (> 0), ``median_tokens`` (>= 1), ``sigma`` (>= 0: 0 is a constant length),
    ``max_tokens`` (>= median_tokens): see the module docstring. ``seed`` seeds the length draws.
    """

    engine_kind = "decode_latency"

    def __init__(self, inner: Engine, ms_per_token: float | None, median_tokens: float, sigma: float,
                 max_tokens: int, seed: int = 0, cost=None):
        if cost is None and (ms_per_token is None or not math.isfinite(ms_per_token) or ms_per_token <= 0):
            raise ValueError(f"ms_per_token={ms_per_token} must be a finite number > 0 "
                             "(sim.decode_ms_per_token)")
        self.cost = cost
        """None: flat ``ms_per_token`` per step; else ``cost(rows, ctx_tokens) -> ms`` per step."""
        self.lengths = ReasoningLengths(median_tokens, sigma, max_tokens, seed)
        self.inner = inner
        self.ms_per_token = float(ms_per_token) if ms_per_token is not None else float("nan")
        self.median_tokens, self.sigma, self.max_tokens = (self.lengths.median_tokens, self.lengths.sigma,
                                                           self.lengths.max_tokens)
        self._lock = threading.Lock()  # the "device": one call at a time, weights swap between calls
        self._stats_lock = threading.Lock()
        self.calls = 0
        self.rows = 0
        self.simulated_tokens = 0
        """Sum over rows of the drawn reasoning lengths."""
        self.simulated_s = 0.0
        """Seconds slept (sum over calls of ms_per_token * longest row)."""
        self.wall_s = 0.0
        """Seconds inside ``generate``: queueing for the lock + the inner call + the sleep."""

    def draw_tokens(self, n: int) -> np.ndarray:
        """n reasoning lengths (int64), lognormal(ln median, sigma) rounded and clipped to [1, max_tokens]."""
        return self.lengths.draw(n)

    def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                 max_new_tokens_per_prompt: Sequence[int] | None = None) -> list[Generation]:
        t0 = time.perf_counter()
        with self._lock:
            if max_new_tokens_per_prompt is None:
                gens = self.inner.generate(prompts, params)
            else:
                gens = self.inner.generate(prompts, params, max_new_tokens_per_prompt)
            lengths = self.draw_tokens(len(gens))
            if self.cost is None:
                sleep_s = self.ms_per_token * int(lengths.max(initial=0)) / 1000.0
            else:
                ctx = [len(p) + len(g.token_ids) for p, g in zip(prompts, gens)]
                sleep_s = static_sleep_ms(self.cost, ctx, lengths) / 1000.0
            if sleep_s > 0:
                time.sleep(sleep_s)
        with self._stats_lock:
            self.calls += 1
            self.rows += len(gens)
            self.simulated_tokens += int(lengths.sum())
            self.simulated_s += sleep_s
            self.wall_s += time.perf_counter() - t0
        return gens

    # The weight path is the inner engine's, untouched: a benchmark times the real broadcast.
    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def model(self):
        return getattr(self.inner, "model", None)

    def load_weights(self, named_tensors, version: int) -> None:
        with self._lock:  # as on a static-batch engine: never during a call, simulated part included
            self.inner.load_weights(named_tensors, version)

    def parameter_specs(self):
        return self.inner.parameter_specs()

    def state_checksum(self) -> float:
        with self._lock:
            return self.inner.state_checksum()

    def engine_stats(self) -> dict:
        """Calls, rows, simulated tokens and seconds, and wall seconds inside ``generate`` so far."""
        with self._stats_lock:
            return {"engine": f"{self.engine_kind}({type(self.inner).__name__})", "calls": self.calls,
                    "rows": self.rows, "simulated_tokens": self.simulated_tokens,
                    "simulated_s": self.simulated_s, "wall_s": self.wall_s, "token_ms": self.ms_per_token,
                    "median_tokens": self.median_tokens, "sigma": self.sigma, "max_tokens": self.max_tokens}

    def __repr__(self) -> str:
        return (f"DecodeLatencyEngine({type(self.inner).__name__}, ms_per_token={self.ms_per_token}, "
                f"median_tokens={self.median_tokens}, sigma={self.sigma}, max_tokens={self.max_tokens})")
