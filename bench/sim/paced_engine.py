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

With ``prefill`` (``gpu_cost.Prefill7BCost`` is the calibrated one) a step also pays for prompt
processing: ``prefill(tokens)`` for the prompts it admits, and, in the first step after a weight swap
with rows in flight (running or holding a slot), ``prefill(their contexts)``: the KV cache the old
weights computed is recomputed with the new ones (the production engine does this for its running
rows, ``_recompute_cache``; a real-size engine pays it for every row still generating). Without
``prefill`` nothing of this is charged, as before. ``context_scale`` multiplies the real tokens of a
context (prompt + tokens so far) in every cost, so the tiny policy's short contexts stand for a
real job's longer ones; simulated tail tokens count one each.

Every step where the real work (the tiny model's forward, sampling, bookkeeping) took longer than the
simulated step is counted (``overrun_steps``, ``overrun_s``): the simulated clock fell behind there.

What the workload realised, for the benchmark's workload check (``engine_stats``): the rows and context
tokens every decode step was charged for (``charged_rows``, ``charged_ctx_tokens``: their ratio is the
row-weighted mean decode context in real-job tokens), the hidden tokens drawn (``tail_tokens``), and with
``turn_marker`` (the token id of the protocol's documents tag, which the rollout appends once per search
step) the admitted rows by how many markers their prompt holds (``turn_marker_rows_<count>``): a
trajectory's turn k prompt holds k-1 more than its first turn's, so the rows with k-1 more markers than
the fewest are the turn-k rows, one per trajectory that reached turn k.

Step accounting: rows held at the start of a step each spend it on one simulated token; a row whose
real tokens end in a step is held from the next one. A slot frees at the end of the step that
consumed the row's last simulated token, before the next step's admission; the caller gets the
row then. It uses the production engine's extension points (``_release``, ``_held``) and wraps its
``_step``; everything else (sampling, the cache, weight swaps, failure handling) is production code.
"""
from __future__ import annotations

import math
import time

import numpy as np

from sonar.actors.engine_continuous import ContinuousHFEngine
from sonar.bench.sim.decode_latency import ReasoningLengths


class PacedContinuousHFEngine(ContinuousHFEngine):
    """``ContinuousHFEngine`` plus the pacing of the module docstring. ``step_ms`` (> 0): the simulated
    decode step in ms; ``median_tokens``, ``sigma``, ``max_tokens``: the hidden reasoning length per
    turn; ``seed`` seeds the length draws."""

    def __init__(self, model, eos_token_id: int | None, device="cpu", max_batch: int = 64, *,
                 step_ms: float | None = None, cost=None, median_tokens: float = 16.0, sigma: float = 0.7,
                 max_tokens: int = 256, seed: int = 0, prefill=None, context_scale: float = 1.0,
                 turn_marker: int | None = None):
        if cost is None:
            if step_ms is None or not math.isfinite(step_ms) or step_ms <= 0:
                raise ValueError(f"step_ms={step_ms} must be a finite number > 0 (sim.decode_ms_per_token)")
            from sonar.bench.sim.gpu_cost import FlatCost

            cost = FlatCost(step_ms)
        if not (math.isfinite(context_scale) and context_scale >= 1.0):
            raise ValueError(f"context_scale={context_scale} must be a finite number >= 1 (sim.context_scale)")
        lengths = ReasoningLengths(median_tokens, sigma, max_tokens, seed)  # validates before the model moves
        super().__init__(model, eos_token_id, device=device, max_batch=max_batch)
        self.cost = cost
        """``cost(rows, ctx_tokens) -> ms`` of one decode step."""
        self.step_ms = float(step_ms) if step_ms is not None else float("nan")
        self.lengths = lengths
        self._tailing: list[tuple[object, int, int]] = []
        """(row, simulated tokens left, context once the tail is done) of rows that left the KV cache and
        still hold a slot; decode thread."""
        self.prefill = prefill
        """``prefill(tokens) -> ms`` of prompt processing, or None (not charged)."""
        self.context_scale = float(context_scale)
        self.simulated_s = 0.0
        """Sum over steps of the step cost (the simulated model time), in seconds."""
        self.prefill_s = 0.0
        """Of ``simulated_s``: prefill of admitted prompts, in seconds."""
        self.recompute_s = 0.0
        """Of ``simulated_s``: KV recomputes after weight swaps, in seconds."""
        self.sim_recomputes = 0
        """Weight swaps that found rows in flight (each charged one recompute of their contexts)."""
        self.overrun_steps = 0
        """Steps whose real work took longer than their simulated cost."""
        self.overrun_s = 0.0
        """Sum over those steps of real work minus simulated cost, in seconds."""
        self.ctx_admitted = [0, 0, 0]
        """(prompts admitted, their context tokens in all, the largest), contexts times ``context_scale``:
        the contexts the costs were charged for."""
        self._paced_version: int | None = None
        """The weights version the previous step ran with (None before the first step); decode thread."""
        self.charged_rows = 0
        """Sum over decode steps of the rows the cost was charged for."""
        self.charged_ctx_tokens = 0
        """Sum over decode steps of the context tokens the cost was charged for (real-job tokens)."""
        self.tail_tokens = 0
        """Hidden (simulated) tokens drawn for the turns released so far."""
        self.turn_marker = turn_marker
        """Token id counted in every admitted prompt (None: not counted)."""
        self.marker_rows: dict[int, int] = {}
        """Admitted rows by the number of ``turn_marker`` tokens in their prompt."""

    @classmethod
    def like(cls, engine: ContinuousHFEngine, **pacing) -> "PacedContinuousHFEngine":
        """A paced engine with ``engine``'s model, EOS id, device and slot count (``engine`` must not have
        generated yet: it is replaced, not wrapped)."""
        return cls(engine.model, engine.eos_token_id, device=engine.device, max_batch=engine.max_batch, **pacing)

    def _release(self, r) -> None:
        tail = int(self.lengths.draw(1)[0])
        self.tail_tokens += tail
        self._tailing.append((r, tail, len(r.prompt) + len(r.ids) + tail))

    def _held(self) -> list:
        return [t[0] for t in self._tailing]

    def inflight_context(self) -> int:
        """Context tokens of the rows in flight: the running rows (prompt + tokens so far) and the held rows
        (prompt + real tokens + simulated tokens so far), real tokens times ``context_scale``."""
        k = self.context_scale
        ctx = sum(k * (len(r.prompt) + len(r.ids)) for r in self._rows)
        ctx += sum(end - left + (k - 1.0) * (end - tail) for _, left, end, tail in self._tail_parts())
        return int(round(ctx))

    def _tail_parts(self):
        """(row, simulated tokens left, context once done, simulated tokens in all) per held row: its real
        tokens are ``end - tail``."""
        return [(r, left, end, end - len(r.prompt) - len(r.ids)) for r, left, end in self._tailing]

    def step_load(self, admit) -> tuple[int, int]:
        """(rows, context tokens) of the step about to run: the rows in flight (``inflight_context``) and
        ``admit`` (prompt, times ``context_scale``)."""
        ctx = self.inflight_context() + int(round(self.context_scale * sum(len(r.prompt) for r in admit)))
        return len(self._rows) + len(admit) + len(self._tailing), ctx

    def step_prefill_ms(self, admit) -> tuple[float, float]:
        """(prefill ms of ``admit``'s prompts, recompute ms of the rows in flight if the weights changed
        since the previous step); (0, 0) without a prefill model."""
        version, seen = self.version, self._paced_version
        self._paced_version = version
        sizes = [int(round(self.context_scale * len(r.prompt))) for r in admit]
        if sizes:
            marks = ([int(np.count_nonzero(np.asarray(r.prompt) == self.turn_marker)) for r in admit]
                     if self.turn_marker is not None else [])
            with self._cv:
                self.ctx_admitted[0] += len(sizes)
                self.ctx_admitted[1] += sum(sizes)
                self.ctx_admitted[2] = max(self.ctx_admitted[2], max(sizes))
                for c in marks:
                    self.marker_rows[c] = self.marker_rows.get(c, 0) + 1
        if self.prefill is None:
            return 0.0, 0.0
        pre = self.prefill(sum(sizes)) if sizes else 0.0
        rec = 0.0
        if seen is not None and version != seen and (self._rows or self._tailing):
            rec = self.prefill(self.inflight_context())
            with self._cv:
                self.sim_recomputes += 1
        return pre, rec

    def _step(self, admit) -> None:
        t0 = time.perf_counter()
        pre_ms, rec_ms = self.step_prefill_ms(admit)
        rows, ctx = self.step_load(admit)
        step_s = (self.cost(rows, ctx) + pre_ms + rec_ms) / 1000.0
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
            time.sleep(spare)  # simulated model time, not synchronisation: nothing waits on it
        with self._cv:
            self.simulated_s += step_s
            self.charged_rows += rows
            self.charged_ctx_tokens += ctx
            self.prefill_s += pre_ms / 1000.0
            self.recompute_s += rec_ms / 1000.0
            if spare < 0:
                self.overrun_steps += 1
                self.overrun_s -= spare

    def engine_stats(self) -> dict:
        st = super().engine_stats()
        with self._cv:
            st.update(engine="paced(hf-continuous)", simulated_s=self.simulated_s, token_ms=self.step_ms,
                      decode_cost=getattr(self.cost, "name", type(self.cost).__name__),
                      median_tokens=self.lengths.median_tokens, sigma=self.lengths.sigma,
                      max_tokens=self.lengths.max_tokens, prefill_s=self.prefill_s, recompute_s=self.recompute_s,
                      sim_recomputes=self.sim_recomputes, overrun_steps=self.overrun_steps,
                      overrun_s=self.overrun_s, context_scale=self.context_scale,
                      ctx_admitted_n=self.ctx_admitted[0], ctx_admitted_tokens=self.ctx_admitted[1],
                      ctx_admitted_max=self.ctx_admitted[2], charged_rows=self.charged_rows,
                      charged_ctx_tokens=self.charged_ctx_tokens, tail_tokens=self.tail_tokens,
                      **{f"turn_marker_rows_{c}": n for c, n in self.marker_rows.items()},
                      prefill_cost=getattr(self.prefill, "name", None if self.prefill is None
                                           else type(self.prefill).__name__))
        return st
