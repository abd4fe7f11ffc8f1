"""Generation engines behind one interface: token ids in, token ids and sampling logprobs out.

The interface fits both the transformers engine (CPU and GPU, :class:`HFEngine`, defined here) and
vLLM (``engine_vllm.py``, on GPU and, built for x86 CPUs, on CPU):

- ``generate(prompts, params)``: one ``Generation`` per prompt, in order. Stops on any id in
  ``params.stop_token_ids`` (the stop token is included in the output), at the first generated token
  whose decoded text completes one of ``params.stop_strings`` (that token included, whatever text it
  carries after the stop string; :class:`StopStrings`), or after ``max_new_tokens``. Token ids stay
  in and out either way: stop strings only decide where a row ends.
  An optional per-prompt cap (``max_new_tokens_per_prompt``) lets the rollout loop respect each
  trajectory's remaining token budget inside one batched call.
- Logprobs are ``log_softmax(raw logits / temperature)`` of the sampled token over the full
  vocabulary (no top-k), so the learner recomputes the same numbers. With ``top_p`` < 1 the sampler
  draws from the renormalised nucleus, but the logprob stays the full distribution's (see
  ``SamplingParams.top_p``). Greedy (temperature 0) reports the logprob of the argmax under the
  temperature-1 distribution.
- ``load_weights(named_tensors, version)`` swaps weights by name; ``parameter_specs()`` gives the
  order, shapes and dtypes the weight-broadcast buckets follow; ``state_checksum()`` lets tests and
  the driver check that every worker holds the learner's weights.

Why not ``model.generate``: its ``scores`` are *processed* logits (top-k 50 by default, warpers),
so behaviour logprobs computed from them disagree with the learner by up to 3 nats. The loop here
samples from, and reports, exactly ``softmax(raw_logits / T)`` over the full vocabulary.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    """Tokens generated per prompt at most (the stop token counts)."""
    temperature: float = 1.0
    """0 = greedy; > 0 samples from softmax(logits / temperature) over the full vocabulary."""
    top_p: float = 1.0
    """Nucleus sampling, per row and step: draw from the most likely tokens whose probability under
    softmax(logits / temperature) reaches top_p (the crossing token included), renormalised. Only the
    *sampler* is truncated: the reported logprob stays log_softmax(logits / temperature) over the full
    vocabulary (what the learner recomputes), which is lower than the truncated sampler's own logprob
    by -log(nucleus mass). 1.0 (no truncation) keeps reported and behaviour logprobs identical."""
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    """A row also stops at the first generated token whose decoded text (the row's generated ids
    alone, special tokens kept) completes one of these strings; that token is kept, even when it
    carries text after the stop string (``"</search>\n"``). Used for tags kept as plain text
    (``model.tags='text'``): a tag is then several tokens, and BPE may merge its last characters
    with what follows. The engine needs a tokenizer for these (``HFEngine(tokenizer=...)``)."""
    seed: int | None = None
    """Seeds the sampler's torch.Generator for this call; None draws a fresh random seed."""

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if any(not isinstance(x, str) or not x for x in self.stop_strings):
            raise ValueError(f"SamplingParams.stop_strings={self.stop_strings!r} must be non-empty strings")


@dataclass
class Generation:
    token_ids: np.ndarray
    """int32 [n], the stop token included when finish == 'stop'."""
    logprobs: np.ndarray
    """float32 [n]"""
    finish: str
    """'stop' | 'length'"""
    version: int
    """Policy version of the weights that sampled these tokens (weights swap only between calls)."""
    stop_token_id: int | None = None
    stop_string: str | None = None
    """The stop string that ended the row (``finish == 'stop'`` on a string; ``stop_token_id`` None)."""
    version_spans: tuple[tuple[int, int, int], ...] = ()
    """Set only when more than one weights version sampled these tokens (the vLLM engine's
    ``rollout.weight_update='interrupt'``): ``(version, start, end)`` token ranges in order, and
    ``version`` is then the oldest of them (staleness checks stay conservative). Empty: all ``version``."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class StopStrings:
    """Incremental stop-string detection for one row: ``push`` each generated id in order; it returns
    the stop string that the text decoded so far completes first (None until then).

    The text is the row's generated ids decoded alone with special tokens kept, as the rollout loop
    decodes a MODEL segment. Fast tokenizers decode incrementally (``tokenizers.decoders.DecodeStream``,
    what vLLM's detokenizer runs: O(1) per token, holding back a partial UTF-8 character until it is
    complete); any other tokenizer re-decodes the ids so far at each step (O(n) per token). Only the
    text a token added can complete a stop string, so the search starts ``len(stop) - 1`` characters
    before it: a stop string spanning several tokens is found at the token that completes it.
    """

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.stops = tuple(stops)
        if not self.stops or any(not s for s in self.stops):
            raise ValueError(f"stop strings {self.stops!r} must be a non-empty list of non-empty strings")
        self._tok = tokenizer
        self._longest = max(len(s) for s in self.stops)
        self._ids: list[int] = []
        self.text = ""
        backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        try:
            from tokenizers import Tokenizer
            from tokenizers.decoders import DecodeStream

            if isinstance(backend, Tokenizer):
                self._backend, self._stream = backend, DecodeStream(skip_special_tokens=False)
        except ImportError:  # pragma: no cover - tokenizers ships with transformers
            pass

    def push(self, token_id: int) -> str | None:
        token_id = int(token_id)
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - a stream the decoder cannot continue: decode whole from now on
                self._stream = None
            else:
                if not piece:  # nothing decodable yet (a partial character), or an empty token
                    return None
                start = max(0, len(self.text) - self._longest + 1)
                self.text += piece
                return first_stop(self.text, self.stops, start)
        # Re-decoded whole: earlier characters may change (a completed character), so search it all.
        self.text = self._tok.decode(self._ids, skip_special_tokens=False)
        return first_stop(self.text, self.stops)


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> str | None:
    """The stop string whose first occurrence in ``text[start:]`` ends first (ties: list order), or None."""
    best, best_end = None, None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best_end is None or i + len(s) < best_end):
            best, best_end = s, i + len(s)
    return best


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the end of its first stop string (unchanged when it has none): the token that
    completed a stop string may carry more text, which belongs to no action."""
    ends = [i + len(s) for s in stops if (i := text.find(s)) >= 0]
    return text[:min(ends)] if ends else text


def resolve_caps(params: SamplingParams, n: int, per_prompt: Sequence[int] | None) -> list[int]:
    """Per-prompt new-token caps, each clipped to ``params.max_new_tokens`` (shared by every engine)."""
    if per_prompt is None:
        return [params.max_new_tokens] * n
    if len(per_prompt) != n:
        raise ValueError(f"max_new_tokens_per_prompt has {len(per_prompt)} entries for {n} prompts")
    return [max(0, min(int(c), params.max_new_tokens)) for c in per_prompt]


class Engine(Protocol):
    version: int

    def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                 max_new_tokens_per_prompt: Sequence[int] | None = None) -> list[Generation]:
        """One Generation per prompt, in order. ``max_new_tokens_per_prompt[i]`` (optional) caps
        prompt i below ``params.max_new_tokens``; callers pass it only when the caps differ."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def parameter_specs(self) -> list[ParamSpec]: ...

    def state_checksum(self) -> float: ...


# ---------------------------------------------------------------- transformers engine

class HFEngine:
    """Batched sampling for a Hugging Face causal LM with a KV cache, written as its own loop.

    Notation: B prompts in a chunk (<= ``max_batch``), L the longest prompt of the chunk, V vocab.

    Per chunk: prompts are left-padded to ``[B, L]`` with an attention mask and explicit
    ``position_ids = cumsum(mask) - 1`` (so a padded row's first real token sits at position 0,
    exactly as in the learner's unpadded forward); one prefill fills a ``DynamicCache``; then every
    step feeds one token per row. At each step the last logits ``[B, V]`` (float32) give
    ``logp = log_softmax(logits / T)``; the token is sampled from ``exp(logp)`` (full vocabulary, no
    top-k) with a ``torch.Generator`` seeded from ``params.seed``; its ``logp`` is the reported
    logprob. T == 0 is greedy and reports ``log_softmax(logits)`` (T = 1). A row stops after a stop
    token (kept in the output), after the token that completes a stop string (``StopStrings``, with
    ``tokenizer``; kept too) or at its token cap; finished rows are dropped from the batch and the
    cache (``batch_select_indices``) so the long tail does not pay for them.

    Prompts are sorted by length before chunking (less padding) and returned in input order.

    Thread safety: ``generate``, ``load_weights`` and ``state_checksum`` hold one lock, so weights
    never change in the middle of a generate call: every token of a Generation comes from the
    version stamped on it, which is what the learner's staleness accounting assumes.
    """

    def __init__(self, model, eos_token_id: int | None, device: str | torch.device = "cpu",
                 max_batch: int = 64, tokenizer=None):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.tokenizer = tokenizer
        """Decodes generated ids for ``SamplingParams.stop_strings`` (None: stop strings refused)."""
        self.device = torch.device(device)
        self.model = model.to(self.device)
        # Generation only: dropout off. The engine owns its model (a copy of the learner's).
        self.model.eval()
        self.eos_token_id = eos_token_id
        self.max_batch = max_batch
        self.version = 0
        self._lock = threading.Lock()
        cfg = getattr(model, "config", None)
        pad = getattr(cfg, "pad_token_id", None) if cfg is not None else None
        # Padding positions are masked out, so any valid id works as filler.
        self._pad_id = int(pad) if isinstance(pad, int) and pad >= 0 else (int(eos_token_id) if eos_token_id is not None else 0)

    # ------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                 max_new_tokens_per_prompt: Sequence[int] | None = None) -> list[Generation]:
        """Sample continuations. ``prompts[i]``: int [n_i >= 1]. Returns one Generation per prompt.

        Stops on ``params.stop_token_ids``, on the engine's EOS id and on ``params.stop_strings``.
        The per-prompt caps (optional) are clipped to ``params.max_new_tokens``.
        """
        seqs, caps, stop, gen = self._prepare_call(prompts, params, max_new_tokens_per_prompt)
        n = len(seqs)
        out: list[Generation | None] = [None] * n
        order = sorted(range(n), key=lambda i: len(seqs[i]))
        with self._lock, torch.inference_mode():
            version = self.version
            for c0 in range(0, n, self.max_batch):
                idx = order[c0:c0 + self.max_batch]
                res = self._generate_chunk([seqs[i] for i in idx], [caps[i] for i in idx], params, stop, gen)
                for i, (ids, lps, finish, stop_id, stop_str) in zip(idx, res):
                    out[i] = Generation(np.asarray(ids, dtype=np.int32), np.asarray(lps, dtype=np.float32),
                                        finish, version, stop_id, stop_str)
        return out  # type: ignore[return-value]

    def _prepare_call(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                      per_prompt: Sequence[int] | None):
        """Validated (int64 prompts, per-prompt caps, stop ids incl. EOS, seeded torch.Generator) of one call."""
        params.validate()
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop_strings={params.stop_strings!r}: this {type(self).__name__} has "
                             "no tokenizer to decode with (construct it with tokenizer=...)")
        caps = resolve_caps(params, len(prompts), per_prompt)
        seqs = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
        for i, s in enumerate(seqs):
            if s.size == 0:
                raise ValueError(f"prompt {i} is empty: generation needs at least one context token")
        stop = set(int(t) for t in params.stop_token_ids)
        if self.eos_token_id is not None:
            stop.add(int(self.eos_token_id))
        gen = torch.Generator(device=self.device)
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(params.seed))
        return seqs, caps, stop, gen

    def _left_pad(self, seqs: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ``[B, L]`` ids and mask on the device, and ``position_ids = cumsum(mask) - 1``, so a
        padded row's first real token sits at position 0, exactly as in the learner's unpadded forward."""
        L = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), L), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for r, x in enumerate(seqs):
            ids[r, L - len(x):] = torch.from_numpy(np.asarray(x, dtype=np.int64))
            mask[r, L - len(x):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0)

    def _generate_chunk(self, seqs: list[np.ndarray], caps: list[int], params: SamplingParams,
                        stop: set[int], gen: torch.Generator):
        from transformers import DynamicCache

        B = len(seqs)
        ids_out: list[list[int]] = [[] for _ in range(B)]
        lps_out: list[list[float]] = [[] for _ in range(B)]
        finish = ["length"] * B
        stop_ids: list[int | None] = [None] * B
        stop_strs: list[str | None] = [None] * B
        matchers = [StopStrings(self.tokenizer, params.stop_strings) for _ in range(B)] if params.stop_strings else None
        live = [b for b in range(B) if caps[b] > 0]
        if not live:
            return [(ids_out[b], lps_out[b], finish[b], stop_ids[b], stop_strs[b]) for b in range(B)]

        dev = self.device
        input_ids, mask, pos = self._left_pad([seqs[b] for b in live])
        cache = DynamicCache(config=self.model.config)  # per-layer types (sliding window etc.)
        rows = torch.tensor(live, dtype=torch.long)          # chunk row of each batch row
        cap_t = torch.tensor([caps[b] for b in live], dtype=torch.long)
        stop_t = torch.tensor(sorted(stop), dtype=torch.long, device=dev) if stop else None
        T = float(params.temperature)

        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=pos,
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]
        last_pos = pos[:, -1]
        step = 0
        while True:
            tok, lp = self._sample(logits.float(), T, params.top_p, gen)   # [b], [b]
            step += 1
            tok_l, lp_l = tok.tolist(), lp.tolist()
            is_stop = torch.isin(tok, stop_t) if stop_t is not None else torch.zeros_like(tok, dtype=torch.bool)
            is_stop = is_stop.cpu()
            for r, b in enumerate(rows.tolist()):
                ids_out[b].append(tok_l[r])
                lps_out[b].append(lp_l[r])
                if is_stop[r]:
                    finish[b], stop_ids[b] = "stop", tok_l[r]
                elif matchers is not None and (hit := matchers[b].push(tok_l[r])) is not None:
                    finish[b], stop_strs[b] = "stop", hit
                    is_stop[r] = True
            done = is_stop | (cap_t <= step)
            if bool(done.all()):
                break
            if bool(done.any()):
                keep = torch.nonzero(~done).flatten()
                keep_d = keep.to(dev)
                cache.batch_select_indices(keep_d)
                rows, cap_t = rows[keep], cap_t[keep]
                tok, mask, last_pos = tok[keep_d], mask[keep_d], last_pos[keep_d]
            mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=dev)], dim=1)
            last_pos = last_pos + 1
            logits = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                                past_key_values=cache, use_cache=True).logits[:, -1, :]
        return [(ids_out[b], lps_out[b], finish[b], stop_ids[b], stop_strs[b]) for b in range(B)]

    @staticmethod
    def _sample(logits: torch.Tensor, T: float, top_p: float, gen: torch.Generator):
        """logits float32 [b, V] -> (token [b] long, logprob [b] float32) under log_softmax(logits / T).

        T == 0: greedy argmax, logprob under T = 1. top_p < 1 truncates only the sampler.
        """
        if T == 0.0:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logits.argmax(dim=-1)
        else:
            logp = torch.log_softmax(logits / T, dim=-1)
            probs = logp.exp()
            if top_p < 1.0:
                sp, si = probs.sort(dim=-1, descending=True)
                drop = (sp.cumsum(-1) - sp) >= top_p      # keep the token that crosses top_p
                sp = sp.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(-1, si, sp)
            # Exponential race (== multinomial draw, ~10x cheaper than torch.multinomial here):
            # argmax_j p_j / E_j with E_j ~ Exp(1) picks j with probability p_j.
            e = torch.empty_like(probs).exponential_(generator=gen)
            tok = (probs / e).argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    # ------------------------------------------------------------ weights
    def sleep(self, level: int) -> dict:
        """Colocated placement: free the device for the learner. On a GPU the model goes to host memory (at
        either level: transformers has no cheaper way to give the memory back); on CPU there is nothing to
        free. Returns ``{"seconds", "freed"}``."""
        t0 = time.perf_counter()
        freed = self.device.type == "cuda"
        if freed:  # pragma: no cover - needs CUDA
            self.model.to("cpu")
            torch.cuda.empty_cache()
        return {"seconds": time.perf_counter() - t0, "freed": freed}

    def wake_up(self, tags=None) -> dict:
        """Undo :meth:`sleep` (the whole model at once: ``tags`` are vLLM's and change nothing here)."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA
            self.model.to(self.device)
        return {"seconds": time.perf_counter() - t0}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy tensors into the model by parameter name and set ``self.version = version``.

        All-or-nothing: every name and shape is checked before anything is copied, so a bad bucket
        never leaves a mix of two versions. (The iterable is materialised, so producers must not
        reuse one buffer across items.) Names may be any alias ``named_parameters(remove_duplicate=False)``
        knows (e.g. ``lm_head.weight`` of a tied model). Partial updates are allowed.
        Raises ValueError naming the parameter for an unknown name or a shape mismatch.
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))
        items = list(named_tensors)
        for name, t in items:
            p = params.get(name)
            if p is None:
                raise ValueError(f"load_weights: unknown parameter {name!r}")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"load_weights: parameter {name!r} has shape {tuple(p.shape)}, "
                                 f"got {tuple(t.shape)}")
        with self._lock, torch.no_grad():
            for name, t in items:
                p = params[name]
                p.copy_(t.to(device=p.device, dtype=p.dtype))
            self.version = int(version)

    def parameter_specs(self) -> list[ParamSpec]:
        """Every trainable parameter, in ``named_parameters()`` order (tied weights once)."""
        return [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in self.model.named_parameters() if p.requires_grad]

    def state_checksum(self) -> float:
        """float64 checksum of all parameters (named_parameters order, tied weights once).

        ``sum_i (i + 1) * (sum|p_i| + 1e-3 * sum_j p_ij * w_j)`` with w_j = (j mod 13) + 1, so it
        changes with values, signs, positions inside a tensor and the assignment to tensors.
        Equal weights give equal checksums up to float64 summation order (compare with rel 1e-9).
        """
        total = 0.0
        with self._lock, torch.no_grad():
            for i, (_, p) in enumerate(self.model.named_parameters()):
                x = p.detach().to("cpu", torch.float64).reshape(-1)
                w = (torch.arange(x.numel(), dtype=torch.float64) % 13) + 1.0
                total += (i + 1) * (float(x.abs().sum()) + 1e-3 * float((x * w).sum()))
        return total
