"""``ContinuousHFEngine``: the transformers engine with continuous batching across concurrent calls.

Why: ``HFEngine`` (and the offline ``VLLMEngine``) run one ``generate`` call at a time as a static
batch, so a worker's lanes (``rollout.batches_in_flight``) queue for the engine and a call holds
the engine until its longest row is done. Here every call's rows join one running batch at the next
decode step, and a row leaves the batch the step it finishes: the engine is shared the way vLLM's
async engine shares a GPU, and a long row delays nobody but its own caller.

Mechanics (notation: R rows in the running batch, L the KV length, V the vocabulary):

- ``generate`` enqueues its rows and blocks until all of them are done; a single decode thread owns
  the model. One loop iteration = one step: (1) rows already in the batch feed their last sampled
  token (``[R, 1]`` forward, mask ``[R, L + 1]``, explicit per-row positions); (2) newly admitted
  rows are prefilled together (left-padded, ``position_ids = cumsum(mask) - 1`` exactly as in
  ``HFEngine``) and their caches are merged into the running one by left-padding the shorter of the
  two along the sequence axis (mask 0 there) and concatenating along the batch axis; (3) every row
  samples with its own call's ``torch.Generator``, temperature and top-p, so logprobs are the exact
  ``log_softmax(logits / T)`` of the sampled token, as in ``HFEngine``.
- A row stops after a stop id of its call (kept), after the token that completes one of its call's
  stop strings (``engine.StopStrings``, one per row; kept) or at its cap; it leaves the cache at once
  (``batch_select_indices``), and leading KV columns no remaining row attends to are cut off.
- At most ``max_batch`` rows are live; further rows wait in FIFO order.
- Weights: ``load_weights`` waits for the current step to end and swaps between steps, so a call
  in flight may continue under newer weights (an interruptible rollout, as in AReaL). The running
  rows' KV cache is then recomputed with the new weights before the next token, so every token is an
  exact sample of one version's policy given its prefix, and its logprob is that policy's;
  ``Generation.version`` is the version at the row's admission, the *oldest* weights that
  contributed, so staleness checks stay conservative.
- Extension points for subclasses: a row that produced its last token leaves the KV cache and goes
  to ``_release`` (here: back to its caller at once); rows a subclass keeps after that are reported by
  ``_held`` and go on holding a batch slot (admission and the idle wait count them). The benchmarks'
  paced engine (``sonar.bench.sim.paced_engine``) uses both, and overrides ``_step``, to simulate a
  larger model's decode time.
- If the decode thread fails, every waiting call raises the error (no silent hang); ``close()``
  stops the thread and fails calls still waiting.

Limits: full-attention caches only (``DynamicLayer``; a sliding-window or recurrent layer is
refused at construction). Determinism: a call's samples depend on which other rows shared its steps
(batched float reductions), so seeds make a call reproducible only when it runs alone.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from sonar.actors.engine import Generation, HFEngine, SamplingParams, StopStrings

log = logging.getLogger(__name__)


@dataclass
class _Call:
    params: SamplingParams
    stop: set[int]
    gen: torch.Generator
    out: list
    pending: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@dataclass
class _Row:
    call: _Call
    index: int
    prompt: np.ndarray
    cap: int
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    version: int = -1
    finish: str = "length"
    stop_id: int | None = None
    stop_string: str | None = None
    matcher: StopStrings | None = None
    """Decodes this row's generated ids for its call's stop strings (None: the call has none)."""


class ContinuousHFEngine(HFEngine):
    """``HFEngine`` with continuous batching (module docstring); ``max_batch`` bounds the live rows."""

    concurrent = True
    """Concurrent ``generate`` calls share decode steps (wrappers must not serialise them)."""

    def __init__(self, model, eos_token_id: int | None, device: str | torch.device = "cpu", max_batch: int = 64,
                 tokenizer=None):
        super().__init__(model, eos_token_id, device=device, max_batch=max_batch, tokenizer=tokenizer)
        self._cv = threading.Condition()
        self._queue: list[_Row] = []
        self._closed = False
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        # Decode-thread state: rows in the KV cache, in cache order.
        self._rows: list[_Row] = []
        self._cache = None
        self._mask: torch.Tensor | None = None       # [R, L] long
        self._last_pos: torch.Tensor | None = None   # [R] long: position of each row's last fed token
        self._next_tok: torch.Tensor | None = None   # [R] long: sampled, not yet fed
        self._cache_version = -1                     # weights version that computed the running cache
        self._swaps_waiting = 0
        self.cache_recomputes = 0
        self.steps = 0
        self.forward_steps = 0
        self.rows_done = 0
        self.max_live = 0
        self.live_row_steps = 0
        """Sum over steps of the rows holding a slot: / steps = the mean batch occupancy."""

    # ------------------------------------------------------------ public
    def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                 max_new_tokens_per_prompt: Sequence[int] | None = None) -> list[Generation]:
        seqs, caps, stop, gen = self._prepare_call(prompts, params, max_new_tokens_per_prompt)
        n = len(seqs)
        if n == 0:
            return []
        call = _Call(params, stop, gen, [None] * n, n)
        rows = [_Row(call, i, seqs[i], caps[i],
                     matcher=StopStrings(self.tokenizer, params.stop_strings) if params.stop_strings else None)
                for i in range(n)]
        with self._cv:
            if self._closed:
                raise RuntimeError("ContinuousHFEngine is closed")
            if self._failed is not None:
                raise RuntimeError("ContinuousHFEngine: the decode thread failed earlier") from self._failed
            for r in rows:
                if r.cap <= 0:
                    self._finish(r, immediate=True)
                else:
                    self._queue.append(r)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="continuous-decode", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        call.done.wait()
        if call.error is not None:
            raise RuntimeError(f"ContinuousHFEngine: decode failed: {call.error!r}") from call.error
        return call.out  # type: ignore[return-value]

    def load_weights(self, named_tensors, version: int) -> None:
        """``HFEngine.load_weights`` at the next step boundary. The decode thread re-takes the model lock
        right after each step, and Python locks are not fair, so it holds off while a swap waits."""
        with self._cv:
            self._swaps_waiting += 1
        try:
            super().load_weights(named_tensors, version)
        finally:
            with self._cv:
                self._swaps_waiting -= 1
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def engine_stats(self) -> dict:
        """Counters so far: decode steps (``forward_steps`` ran the model), rows returned, the most rows
        holding a slot in one step, the sum over steps of those rows (/ steps = mean occupancy), and
        KV-cache recomputes after a weight swap."""
        with self._cv:
            return {"engine": "hf-continuous", "steps": self.steps, "forward_steps": self.forward_steps,
                    "rows": self.rows_done, "max_live_rows": self.max_live,
                    "live_row_steps": self.live_row_steps, "cache_recomputes": self.cache_recomputes}

    # ------------------------------------------------------------ extension points
    def _release(self, r: _Row) -> None:
        """Row ``r`` produced its last token and left the KV cache (decode thread, inside a step). Here
        it goes back to its caller at once; a subclass may keep it (then ``_held`` must list it, and
        the subclass hands it back with ``_finish`` later)."""
        self._finish(r)

    def _held(self) -> list[_Row]:
        """Rows out of the KV cache that still hold a batch slot: none here. Read by the decode thread
        only (admission room, idle wait, occupancy counters, failing every waiting call)."""
        return []

    # ------------------------------------------------------------ decode thread
    def _run(self) -> None:
        admit: list[_Row] = []
        try:
            while True:
                with self._cv:
                    while self._swaps_waiting or not (self._closed or self._queue or self._rows or self._held()):
                        self._cv.wait()
                    if self._closed:
                        raise RuntimeError("ContinuousHFEngine closed with calls in flight")
                    room = self.max_batch - len(self._rows) - len(self._held())
                    admit, self._queue = self._queue[:max(0, room)], self._queue[max(0, room):]
                self._step(admit)
        except BaseException as e:  # noqa: BLE001 -- every waiting caller must hear about it
            with self._cv:
                self._failed = e
                waiting = self._queue + admit + self._rows + self._held()  # admit: taken, maybe not merged
                self._queue, self._rows = [], []
                for r in waiting:
                    if not r.call.done.is_set():
                        r.call.error = e
                        r.call.done.set()
            if not (isinstance(e, RuntimeError) and self._closed):
                log.exception("ContinuousHFEngine decode thread failed")

    def _step(self, admit: list[_Row]) -> None:
        """One decode step: the running rows feed their last token, ``admit`` is prefilled and merged."""
        live = len(self._rows) + len(admit) + len(self._held())
        forward = bool(self._rows or admit)
        with self._lock, torch.inference_mode():  # weights swap only between steps
            version = self.version
            finished: list[int] = []
            if self._rows and self._cache_version != version:
                self._recompute_cache(version)
            if self._rows:
                self._decode_running(finished)
            if admit:
                for r in admit:
                    r.version = version
                self._prefill_and_merge(admit, finished)
            self._drop(finished)
            self.forward_steps += forward
        with self._cv:
            self.steps += 1
            self.live_row_steps += live
            self.max_live = max(self.max_live, live)

    def _recompute_cache(self, version: int) -> None:
        """New weights arrived mid-call: the running rows' keys and values were computed by the old ones,
        so they are recomputed from each row's tokens (prompt + generated, the last sampled token still
        to be fed) with the new weights. Later tokens are then exact samples of the new policy."""
        from transformers import DynamicCache

        seqs = [np.concatenate([r.prompt, np.asarray(r.ids[:-1], dtype=np.int64)]) for r in self._rows]
        ids, mask, pos = self._left_pad(seqs)
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                   logits_to_keep=1)
        self._cache, self._mask, self._last_pos = cache, mask, pos[:, -1]
        self._cache_version = version
        self.cache_recomputes += 1

    def _decode_running(self, finished: list[int]) -> None:
        dev = self.device
        self._mask = torch.cat([self._mask, torch.ones((self._mask.shape[0], 1), dtype=torch.long, device=dev)], 1)
        self._last_pos = self._last_pos + 1
        logits = self.model(input_ids=self._next_tok[:, None], attention_mask=self._mask,
                            position_ids=self._last_pos[:, None], past_key_values=self._cache,
                            use_cache=True).logits[:, -1, :]
        self._next_tok = self._sample_rows(self._rows, logits.float(), 0, finished)

    def _prefill_and_merge(self, admit: list[_Row], finished: list[int]) -> None:
        from transformers import DynamicCache

        ids, mask, pos = self._left_pad([r.prompt for r in admit])
        L = ids.shape[1]
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1, :]
        offset = len(self._rows)
        toks = self._sample_rows(admit, logits.float(), offset, finished)
        if not self._rows:
            self._cache, self._mask, self._last_pos, self._next_tok = cache, mask, pos[:, -1], toks
            self._cache_version = admit[0].version
        else:
            self._cache = _merge_caches(self._cache, cache, self._mask.shape[1], L)
            Lm = max(self._mask.shape[1], L)
            self._mask = torch.cat([F.pad(self._mask, (Lm - self._mask.shape[1], 0)), F.pad(mask, (Lm - L, 0))], 0)
            self._last_pos = torch.cat([self._last_pos, pos[:, -1]])
            self._next_tok = torch.cat([self._next_tok, toks])
        self._rows = self._rows + admit

    def _sample_rows(self, rows: list[_Row], logits: torch.Tensor, offset: int, finished: list[int]) -> torch.Tensor:
        """Sample every row with its own call's generator; append; record rows that finish (cache index)."""
        toks = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        by_call: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_call.setdefault(id(r.call), []).append(i)
        for idx in by_call.values():
            call = rows[idx[0]].call
            sel = torch.tensor(idx, dtype=torch.long, device=logits.device)
            tok, lp = self._sample(logits.index_select(0, sel), float(call.params.temperature), call.params.top_p,
                                   call.gen)
            toks[sel] = tok
            for i, t, p in zip(idx, tok.tolist(), lp.tolist()):
                r = rows[i]
                r.ids.append(t)
                r.lps.append(p)
                if t in call.stop:
                    r.finish, r.stop_id = "stop", t
                    finished.append(offset + i)
                elif r.matcher is not None and (hit := r.matcher.push(t)) is not None:
                    r.finish, r.stop_string = "stop", hit
                    finished.append(offset + i)
                elif len(r.ids) >= r.cap:
                    finished.append(offset + i)
        return toks

    def _drop(self, finished: list[int]) -> None:
        if not finished:
            return
        gone = set(finished)
        keep = [i for i in range(len(self._rows)) if i not in gone]
        for i in sorted(gone):
            self._release(self._rows[i])
        if not keep:
            self._rows, self._cache, self._mask, self._last_pos, self._next_tok = [], None, None, None, None
            return
        k = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._cache.batch_select_indices(k)
        self._rows = [self._rows[i] for i in keep]
        self._mask, self._last_pos, self._next_tok = self._mask[k], self._last_pos[k], self._next_tok[k]
        # Cut KV columns nobody attends to any more (left padding of rows that have left).
        used = self._mask.any(dim=0).nonzero()
        first = int(used[0]) if used.numel() else self._mask.shape[1]
        if first > 0:
            self._mask = self._mask[:, first:]
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]

    def _finish(self, r: _Row, immediate: bool = False) -> None:
        call = r.call
        call.out[r.index] = Generation(np.asarray(r.ids, np.int32), np.asarray(r.lps, np.float32), r.finish,
                                       r.version if r.version >= 0 else self.version, r.stop_id, r.stop_string)
        if not immediate:
            with self._cv:
                self.rows_done += 1
        call.pending -= 1
        if call.pending == 0:
            call.done.set()


def _merge_caches(running, new, l_run: int, l_new: int):
    """Concatenate two DynamicCaches along the batch axis, left-padding the shorter one's sequence axis."""
    from transformers.cache_utils import DynamicLayer

    lm = max(l_run, l_new)
    for a, b in zip(running.layers, new.layers):
        if type(a) is not DynamicLayer or type(b) is not DynamicLayer:
            raise TypeError(f"continuous batching needs full-attention DynamicLayer caches, got {type(a).__name__}")
        a.keys = torch.cat([F.pad(a.keys, (0, 0, lm - l_run, 0)), F.pad(b.keys, (0, 0, lm - l_new, 0))], 0)
        a.values = torch.cat([F.pad(a.values, (0, 0, lm - l_run, 0)), F.pad(b.values, (0, 0, lm - l_new, 0))], 0)
    return running
