"""``BenchEngine``: a BENCHMARK-ONLY generation engine. It does NOT run the model. Never train with it.

What it is for. On a 2-core machine a real forward pass is the bottleneck, so a throughput benchmark
of rollout workers would measure the CPU, not Sonar. ``sim.engine=bench`` swaps in this engine (through
the production engine hook, ``hooks.SimEngineWrap``): it *sleeps* ``token_ms`` per generated token and
emits syntactically valid, protocol-shaped turns, so everything around generation runs for real and
is what gets measured: the rollout loop, parsing,
the retrieval service (real index, real hits), reward computation, the msgpack codec, the replay
queue, and the weight broadcast (``.model`` is the real policy; ``load_weights`` copies into it by
name, exactly like :class:`sonar.actors.engine.HFEngine`, and bumps ``version``; checksums are real).

What it generates, per row of a ``generate`` call (rows are independent draws from a seeded
``numpy`` generator; with ``params.seed`` set the call is reproducible):

- the number of search steps already in the context is the count of ``tags.docs_close`` ids; the
  row answers with hazard 0, 1/3, 1/2, 1 after 0, 1, 2, >= 3 searches, so a trajectory makes 1, 2 or
  3 searches with equal probability, then answers (retrieval is always exercised);
- a search turn is ``think_open <filler> think_close query_open <2-4 words of the context>
  query_close`` (multi-query tag sets sometimes write two queries joined by ``query_sep``); query and
  filler words are drawn from the word-like tokens of the context (the question, retrieved documents,
  earlier turns), so queries are real corpus words and the searches hit real documents;
- an answer turn is ``think_open <filler> think_close answer_open <1-2 words> answer_close``;
- the turn's length is LONG-TAILED: ``lognormal(ln median_tokens, sigma)`` tokens (default median 16,
  sigma 0.7: p90 ~ 40, p99 ~ 82), never shorter than the turn's tag skeleton; the think block absorbs
  the length;
- logprobs are random in [-2.5, -0.05] (plausible, meaningless: the learner's importance ratios are
  therefore garbage; the learner still runs its step for real, which is what a benchmark times);
- stop semantics as in the Engine protocol: the output ends at the first id in
  ``params.stop_token_ids`` (or EOS), kept, ``finish='stop'``; a turn longer than the row's cap
  (``min(params.max_new_tokens, max_new_tokens_per_prompt[i])``) is cut there, ``finish='length'``
  (the long tail hitting the budget, as with a real model); a turn whose closing tag is not a stop id
  keeps "generating" filler up to the cap.

Timing model: rows of one call generate in parallel (as in a batched GPU decode), so the call sleeps
``token_ms * (longest output row)``: a static batch waits for its longest row. There is no prefill
cost and no per-row cost. ``simulated_s`` accumulates the sleep, so a benchmark can subtract the
simulated model time from what it measured and report Sonar's own overhead.

Why a subclass of ``HFEngine``: the weight path (name/shape validation, all-or-nothing copy, lock,
version, ``parameter_specs`` order, ``state_checksum`` formula) must be *the* production code, so the
broadcast a benchmark times is the real one. Only ``generate`` is replaced.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Sequence

import numpy as np

from sonar.actors.engine import Generation, HFEngine, SamplingParams, resolve_caps
from sonar.actors.prompts import TagSet

log = logging.getLogger(__name__)


class BenchEngine(HFEngine):
    """BENCHMARK ENGINE: sleeps ``token_ms`` per token of the longest row instead of running the model.

    ``model``: the real policy (kept as ``.model``; weights load into it, never used for a forward).
    ``tokenizer``: supplies the tag ids, EOS and the word-like vocabulary for filler text.
    ``tags``: the protocol whose turns are produced. ``token_ms``: simulated decode time per token.
    ``seed``: seeds the draws of calls without ``params.seed``. ``median_tokens`` / ``sigma``: the
    lognormal turn length. ``logprob_range``: (low, high) of the uniform fake logprobs.
    """

    engine_kind = "bench"
    """Recorded by benchmarks: numbers from this engine are NOT model generation speed."""

    def __init__(self, model, tokenizer, tags: TagSet, token_ms: float = 2.0, seed: int = 0,
                 median_tokens: float = 16.0, sigma: float = 0.7,
                 logprob_range: tuple[float, float] = (-2.5, -0.05)):
        if not math.isfinite(token_ms) or token_ms < 0:
            raise ValueError(f"token_ms={token_ms} must be >= 0 (sim.token_ms)")
        if median_tokens < 1 or sigma < 0:
            raise ValueError(f"median_tokens={median_tokens} must be >= 1 and sigma={sigma} >= 0")
        lo, hi = logprob_range
        if not (lo <= hi < 0):
            raise ValueError(f"logprob_range={logprob_range}: need low <= high < 0")
        super().__init__(model, eos_token_id=tokenizer.eos_token_id)
        self.tokenizer = tokenizer
        self.tags = tags
        self.token_ms = float(token_ms)
        self.seed = int(seed)
        self.median_tokens = float(median_tokens)
        self.sigma = float(sigma)
        self.logprob_range = (float(lo), float(hi))
        self._rng = np.random.default_rng(abs(self.seed))
        self._stats_lock = threading.Lock()
        self.calls = 0
        self.generated_tokens = 0
        self.simulated_s = 0.0
        """Seconds slept (the simulated model time)."""
        self.wall_s = 0.0
        """Seconds spent inside ``generate`` (sleep + building the fake turns + waiting for the lock)."""

        def tid(tok: str | None) -> int | None:
            if not tok:
                return None
            i = tokenizer.convert_tokens_to_ids(tok)
            if i is None or i == getattr(tokenizer, "unk_token_id", None):
                raise ValueError(f"tokenizer has no id for tag {tok!r}: tags must be special tokens")
            return int(i)

        self.ids = {name: tid(getattr(tags, name)) for name in
                    ("think_open", "think_close", "query_open", "query_close", "answer_open", "answer_close",
                     "docs_close", "query_sep")}
        special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []))
        special |= {i for i in self.ids.values() if i is not None}
        vocab = len(tokenizer)
        toks = tokenizer.convert_ids_to_tokens(list(range(vocab)))
        word = np.zeros(vocab, dtype=bool)
        for i, t in enumerate(toks):
            if i in special or t is None:
                continue
            s = str(t).lstrip("Ġ▁ ")  # BPE / sentencepiece word-start markers
            word[i] = bool(s) and any(c.isalnum() for c in s)
        if not word.any():
            raise ValueError("tokenizer has no word-like tokens to generate text from")
        self._word = word
        self._word_ids = np.flatnonzero(word).astype(np.int64)
        log.warning("BenchEngine in use: a BENCHMARK engine that sleeps %.2f ms/token and does not run the "
                    "model; rewards and logprobs are meaningless", self.token_ms)

    # ------------------------------------------------------------ generation (simulated)
    def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                 max_new_tokens_per_prompt: Sequence[int] | None = None) -> list[Generation]:
        """Protocol-shaped fake turns (see the module docstring); sleeps for the longest row."""
        t_call = time.perf_counter()
        params.validate()
        n = len(prompts)
        caps = resolve_caps(params, n, max_new_tokens_per_prompt)
        stop = set(int(t) for t in params.stop_token_ids)
        if self.eos_token_id is not None:
            stop.add(int(self.eos_token_id))
        rng = (np.random.default_rng([abs(self.seed), abs(int(params.seed))]) if params.seed is not None
               else self._rng)
        with self._lock:  # same lock as load_weights: weights never change inside a call
            version = self.version
            out: list[Generation] = []
            for i in range(n):
                ctx = np.asarray(prompts[i]).reshape(-1)
                if ctx.size == 0:
                    raise ValueError(f"prompt {i} is empty: generation needs at least one context token")
                ids, finish, stop_id = self._row(ctx, caps[i], stop, rng)
                lo, hi = self.logprob_range
                lps = rng.uniform(lo, hi, size=len(ids)).astype(np.float32)
                out.append(Generation(np.asarray(ids, np.int32), lps, finish, version, stop_id))
            longest = max((len(g.token_ids) for g in out), default=0)
            sleep_s = self.token_ms * longest / 1000.0
            if sleep_s > 0:
                time.sleep(sleep_s)
        with self._stats_lock:
            self.calls += 1
            self.generated_tokens += sum(len(g.token_ids) for g in out)
            self.simulated_s += sleep_s
            self.wall_s += time.perf_counter() - t_call
        return out

    def engine_stats(self) -> dict:
        """Calls, generated tokens, simulated (slept) seconds and wall seconds inside ``generate`` so far."""
        with self._stats_lock:
            return {"engine": self.engine_kind, "calls": self.calls, "generated_tokens": self.generated_tokens,
                    "simulated_s": self.simulated_s, "wall_s": self.wall_s, "token_ms": self.token_ms}

    def _words(self, rng: np.random.Generator, k: int, ctx: np.ndarray | None = None) -> list[int]:
        """k word-like ids: from the context when it has any (real corpus words), else the vocabulary."""
        pool = self._word_ids
        if ctx is not None:
            c = ctx[(ctx >= 0) & (ctx < len(self._word))]
            c = c[self._word[c]]
            if c.size:
                pool = c
        return [int(x) for x in rng.choice(pool, size=k)]

    def _turn(self, ctx: np.ndarray, rng: np.random.Generator) -> list[int]:
        I = self.ids
        searches = int(np.count_nonzero(ctx == I["docs_close"])) if I["docs_close"] is not None else 0
        p_answer = 0.0 if searches == 0 else 1.0 / max(1, 4 - searches) if searches < 3 else 1.0
        answer = rng.random() < p_answer
        if answer:
            tail = [I["answer_open"], *self._words(rng, int(rng.integers(1, 3)), ctx), I["answer_close"]]
        else:
            body = self._words(rng, int(rng.integers(2, 5)), ctx[-64:])
            if I["query_sep"] is not None and rng.random() < 0.3:
                body = body + [I["query_sep"]] + self._words(rng, int(rng.integers(1, 4)), ctx[-64:])
            tail = [I["query_open"], *body, I["query_close"]]
        think = I["think_open"] is not None and I["think_close"] is not None
        skeleton = len(tail) + (2 if think else 0)
        length = max(skeleton, int(round(rng.lognormal(math.log(self.median_tokens), self.sigma))))
        filler = self._words(rng, length - skeleton, ctx)
        head = [I["think_open"], *filler, I["think_close"]] if think else filler
        return [i for i in head + tail if i is not None]

    def _row(self, ctx: np.ndarray, cap: int, stop: set[int], rng: np.random.Generator):
        if cap <= 0:
            return [], "length", None
        ids = self._turn(ctx, rng)
        for j, t in enumerate(ids[:cap]):
            if t in stop:
                return ids[:j + 1], "stop", t
        if len(ids) >= cap:
            return ids[:cap], "length", None
        # The closing tag is not a stop id: a real model would keep going until the cap.
        return ids + self._words(rng, cap - len(ids)), "length", None
