"""``PacedContinuousHFEngine``: the continuous-batching engine paced like a real-size policy. BENCHMARKS ONLY.

Why: the CPU policy decodes a step in about a millisecond and writes short turns. The async-vs-sync
benchmark needs the decode profile of a 1-8B search agent on an accelerator while still training the
real policy (see ``decode_latency.py`` for the static-engine version of the same model). With
``sim.decode_ms_per_token`` > 0 the engine hook (``hooks.SimEngineWrap``) replaces the production
``ContinuousHFEngine`` with this subclass, built with the same model, EOS, device and slot count:

- each decode step lasts at least ``step_ms`` (flat: a large model's decode step is memory-bound, so
  the same for 1 or ``max_batch`` rows), or, with ``cost``, at least ``cost(rows, ctx)`` ms where rows
  are the rows holding a slot in the step and ctx the sum of their contexts (prompt + real tokens +
  simulated tokens so far; ``gpu_cost.Gpu7BCost`` is the calibrated one): the step's real work, then a
  sleep for the rest;
- each row, after its real tokens, stays in the batch for ``L`` more steps, with
  ``L ~ lognormal(ln median_tokens, sigma)`` clipped to ``[1, max_tokens]`` (``ReasoningLengths``):
  the long-tailed reasoning a real policy would decode. Those steps hold a slot (admission counts
  them) but run no forward; their tokens are not returned and not trained.

Step accounting: rows held at the start of a step each spend it on one simulated token; a row whose
real tokens end in a step is held from the next one. A slot frees at the end of the step that
consumed the row's last simulated token, before the next step's admission; the caller gets the
row then. It uses the production engine's extension points (``_release``, ``_held``) and wraps its
``_step``; everything else (sampling, the cache, weight swaps, failure handling) is production code.
"""
from __future__ import annotations

import math
import time

from sonar.actors.engine_continuous import ContinuousHFEngine
from sonar.bench.sim.decode_latency import ReasoningLengths


class PacedContinuousHFEngine(ContinuousHFEngine):
    """``ContinuousHFEngine`` plus the pacing of the module docstring. ``step_ms`` (> 0): the simulated
    decode step in ms; ``median_tokens``, ``sigma``, ``max_tokens``: the hidden reasoning length per
    turn; ``seed`` seeds the length draws."""

    def __init__(self, model, eos_token_id: int | None, device="cpu", max_batch: int = 64, *,
                 step_ms: float | None = None, cost=None, median_tokens: float = 16.0, sigma: float = 0.7,
                 max_tokens: int = 256, seed: int = 0):
        if cost is None:
            if step_ms is None or not math.isfinite(step_ms) or step_ms <= 0:
                raise ValueError(f"step_ms={step_ms} must be a finite number > 0 (sim.decode_ms_per_token)")
            from sonar.bench.sim.gpu_cost import FlatCost

            cost = FlatCost(step_ms)
        lengths = ReasoningLengths(median_tokens, sigma, max_tokens, seed)  # validates before the model moves
        super().__init__(model, eos_token_id, device=device, max_batch=max_batch)
        self.cost = cost
        """``cost(rows, ctx_tokens) -> ms`` of one decode step."""
        self.step_ms = float(step_ms) if step_ms is not None else float("nan")
        self.lengths = lengths
        self._tailing: list[tuple[object, int, int]] = []
        """(row, simulated tokens left, context once the tail is done) of rows that left the KV cache and
        still hold a slot; decode thread."""
        self.simulated_s = 0.0
        """Sum over steps of the step cost (the simulated model time), in seconds."""

    @classmethod
    def like(cls, engine: ContinuousHFEngine, **pacing) -> "PacedContinuousHFEngine":
        """A paced engine with ``engine``'s model, EOS id, device and slot count (``engine`` must not have
        generated yet: it is replaced, not wrapped)."""
        return cls(engine.model, engine.eos_token_id, device=engine.device, max_batch=engine.max_batch, **pacing)

    def _release(self, r) -> None:
        tail = int(self.lengths.draw(1)[0])
        self._tailing.append((r, tail, len(r.prompt) + len(r.ids) + tail))

    def _held(self) -> list:
        return [t[0] for t in self._tailing]

    def step_load(self, admit) -> tuple[int, int]:
        """(rows, context tokens) of the step about to run: the running rows (prompt + tokens so far),
        ``admit`` (prompt) and the held rows (prompt + real tokens + simulated tokens so far)."""
        ctx = sum(len(r.prompt) + len(r.ids) for r in self._rows) + sum(len(r.prompt) for r in admit)
        ctx += sum(end - left for _, left, end in self._tailing)
        return len(self._rows) + len(admit) + len(self._tailing), ctx

    def _step(self, admit) -> None:
        t0 = time.perf_counter()
        step_s = self.cost(*self.step_load(admit)) / 1000.0
        n = len(self._tailing)  # held since before this step: each spends it on one simulated token
        super()._step(admit)    # may append rows whose real tokens ended in this step (held from the next)
        still = []
        for r, left, end in self._tailing[:n]:
            if left <= 1:
                self._finish(r)
            else:
                still.append((r, left - 1, end))
        self._tailing = still + self._tailing[n:]
        spare = step_s - (time.perf_counter() - t0)
        if spare > 0:
            time.sleep(spare)
        with self._cv:
            self.simulated_s += step_s

    def engine_stats(self) -> dict:
        st = super().engine_stats()
        with self._cv:
            st.update(engine="paced(hf-continuous)", simulated_s=self.simulated_s, token_ms=self.step_ms,
                      decode_cost=getattr(self.cost, "name", type(self.cost).__name__),
                      median_tokens=self.lengths.median_tokens, sigma=self.lengths.sigma,
                      max_tokens=self.lengths.max_tokens)
        return st
