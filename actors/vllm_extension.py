"""The receiving end of the weight broadcast, inside each of vLLM's worker processes.

vLLM imports this class by its dotted name (``worker_extension_cls``) in every worker process it
starts (one per tensor-parallel rank; on CPU, one worker process beside the engine core) and mixes it
into its worker class, so ``self`` is vLLM's worker: ``self.rank`` is its rank in vLLM's own world
(the tensor-parallel rank here), ``self.model_runner`` holds the model. The engine (``VLLMEngine``)
calls these methods through ``collective_rpc``, which runs them on every rank.

Why here and not in the Ray actor: a tensor cannot cross ``collective_rpc`` (the engine core is
another process, and its msgpack encoder fails on tensors: "cannot pickle memoryview objects"), and
copying weights actor -> engine core -> worker would cost three copies of the model. So each vLLM
worker joins the learner's broadcast group itself (``sonar.cluster.transport.weights.BroadcastGroup``,
gloo on CPU, NCCL on GPU) and receives the buckets straight onto its device. Only names, shapes,
dtypes, addresses and version numbers travel by RPC.

Rank layout: the learner is rank 0; the rollout worker ``i`` owns ranks ``base_i .. base_i + tp - 1``
(``base_i`` from the driver, which counts every worker's ranks), and vLLM's rank ``r`` joins as
``base_i + r``. Every rank receives the full tensors; the model's ``load_weights`` cuts each rank's
tensor-parallel shard and fuses q/k/v and gate/up itself.

Streaming: one call, :meth:`sonar_update`, receives and loads bucket by bucket while the engine has
generation paused: two bucket buffers beside the model (``BroadcastGroup.recv_streamed``), never a
copy of it (a full bf16 copy is 14.2 GiB for a 7B, more than a GPU has left once vLLM took its share).

Loading: vLLM's layerwise reload, used the way its own NCCL weight-transfer engine uses it
(``start_weight_update`` / ``update_weights`` per chunk / ``finish_weight_update``):
``initialize_layerwise_reload(model)`` once, ``model.load_weights(bucket)`` per bucket, then
``finalize_layerwise_reload``. It restores each layer's checkpoint-format parameters, runs the model's
own loaders and the post-load processing again, and copies into the original storage (CUDA-graph
references stay valid). A plain second ``model.load_weights`` outside that session is not enough on
CPU: vLLM prepacks linear weights for its GEMM kernels after the first load and leaves parameters
without a ``weight_loader`` behind. Not ``model_runner.reload_weights`` once per bucket: each call
would restore every layer and finalize the push's half-loaded layers (q without k and v) as garbage.

What the layerwise reload holds (read in vllm/model_executor/model_loader/reload/layerwise.py, 0.32):
each loader call is *buffered* with its arguments, the checkpoint tensor included, until the layer
has received all its elements; only then is the layer materialised and loaded. So a layer whose
tensors straddle two buckets (``gate_proj`` and ``up_proj`` of a 7B, 136 MB each, one bucket each)
keeps the first bucket's tensor past that bucket, and a layer that never counts as complete (an
embedding padded past the vocabulary, loaded fewer elements than it holds) keeps it until
``finalize``. The stream copies exactly those tensors before their buffer is refilled
(``recv_streamed``: ``held_copies``/``held_bytes`` in the result), so the real peak beside the model
is the two buffers + the held copies. For Qwen2.5-7B bf16 (every TP rank receives full tensors):
buffer 0 1.02 GiB (buckets 0 and 114, the embedding and the LM head), buffer 1 130 MiB, and held
copies of at most one ``gate_proj`` (130 MiB) or a q + k pair at a time: about 1.3 GiB, against 14.2
GiB for the full receive copy before. vLLM's own layer materialisation (one layer) comes on top, as
with any reload. Measured on the tiny policy at TP 2 (tests/actors/test_vllm_tp_push.py): 7 held
copies per push on rank 1, exactly q, k and gate of both layers plus the padded embedding.

Checksum: each tensor is summed (``weights.Checksum``, float64 in chunks) as its bucket arrives, exactly
what was received, and stored with its version; :meth:`sonar_checksum` keeps no buffers. (A checksum
over vLLM's own parameters would see fused and prepacked tensors, not the learner's.)

Layers a push cannot reach: the reload's finalize warns "<Layer>: Failed to load weights" for every
layer that counts loadable elements yet received none, and puts its previous tensors back. Two kinds do
so by construction at every push, and those warnings are dropped (``_ReloadMisses``, counted as
``reload_misses_expected``): a layer holding only derived buffers (``RotaryEmbedding``'s cos/sin cache,
computed from the config, never in a checkpoint) and the second owner of a shared weight (a tied
``ParallelLMHead``: the checkpoint holds ``embed_tokens`` only, and ``_reprocess_tied_embeddings`` redoes
its processing). Any other layer named there kept its previous weights: it is kept in vLLM's log and
returned (``reload_misses``) for the engine to report.

LoRA (``learner.lora``): the push carries the adapters only, and vLLM serves the base with LoRA enabled.
A tensor cannot reach vLLM's LoRA manager but through a ``LoRARequest``, which names a directory, so each
rank copies the adapter tensors it receives (megabytes), rank 0 writes them as peft does
(``wire.policy.write_adapter``, atomically over the engine's one adapter directory), and the engine then
replaces its one adapter (``VLLMEngine._areceive``): no layerwise reload, the base untouched.

Imports: torch and ``sonar.cluster.wire`` only (vLLM inside methods) -- this module is imported inside
vLLM's processes.
"""
from __future__ import annotations

import logging
import time

import torch

from sonar.cluster.transport.weights import (DEFAULT_BUCKET_BYTES, BroadcastGroup, Checksum, TensorSpec, layout_digest,
                                        plan_buckets, recv_buffer_bytes)


class SonarWorkerExtension:
    """Mixed into vLLM's worker class; every method runs on every vLLM rank (``collective_rpc``)."""

    def sonar_join(self, master_addr: str, master_port: int, rank_base: int, world_size: int, backend: str,
                   prefix: str, specs: list, timeout_s: float = 300.0, bucket_bytes: int | None = None,
                   lora: dict | None = None) -> dict:
        """Join the broadcast group as rank ``rank_base + self.rank``; blocks until every rank joined.

        ``specs``: ``[(name, shape, dtype name)]`` in the learner's order. ``timeout_s``: the group's
        (rendezvous and every wait of a push). ``bucket_bytes``: the plan's budget (None: the default,
        the learner's). ``lora``: the adapters' settings (``LoraConfig``'s fields) and ``path``, the
        directory rank 0 writes each pushed adapter to (module docstring); None: the push is the model's
        weights. Returns the rank, the layout digest (the engine checks it against the learner's) and the
        bytes of the two receive buffers a push will use."""
        self.sonar_leave()
        tspecs = [TensorSpec(str(n), tuple(int(x) for x in shape), getattr(torch, str(d))) for n, shape, d in specs]
        rank = int(rank_base) + int(self.rank)
        group = BroadcastGroup(master_addr, int(master_port), rank, int(world_size), backend, prefix=prefix,
                               timeout_s=float(timeout_s))
        self._sonar_group = group
        self._sonar_buckets = plan_buckets(tspecs, int(bucket_bytes or DEFAULT_BUCKET_BYTES))
        self._sonar_checksum: tuple[int, float] | None = None
        self._sonar_loaded = -1
        self._sonar_lora = None if lora is None else dict(lora)
        return {"rank": rank, "digest": layout_digest(tspecs), "device": str(group.device),
                "buffer_bytes": recv_buffer_bytes(self._sonar_buckets)}

    def sonar_leave(self) -> None:
        group = getattr(self, "_sonar_group", None)
        if group is not None:
            group.close()
        self._sonar_group = None
        self._sonar_checksum = None

    def sonar_update(self, version: int) -> dict:
        """Collective with the learner's ``send_weights``: receive and load every bucket, streamed
        (module docstring). Generation must be paused (the engine does it). Returns the rank's figures:
        ``seconds`` (receive + load, after the handshake), ``wait_s``, ``load_s``, ``bytes``,
        ``buffer_bytes``, ``held_copies``, ``held_bytes``, ``fresh_buffers``."""
        group = getattr(self, "_sonar_group", None)
        if group is None:
            raise RuntimeError("sonar_update before sonar_join: this vLLM worker is in no broadcast group")
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        self._sonar_checksum = None  # a push that fails half-way leaves no checksum to trust
        self._sonar_loaded = -1
        if getattr(self, "_sonar_lora", None) is not None:
            return self._sonar_update_adapter(group, int(version))
        model = self.model_runner.get_model()
        sums = Checksum()
        t0 = time.perf_counter()
        misses = _ReloadMisses(_unloadable_by_construction(model))
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            try:
                out = group.recv_streamed(self._sonar_buckets, model.load_weights, sums)
            finally:  # never leave layers on the meta device, even after a failed receive
                with misses:  # the filter on vLLM's reload logger while the reload finalizes
                    finalize_layerwise_reload(model, self.vllm_config.model_config)
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
                fn = getattr(self.model_runner, reset, None)
                if callable(fn):
                    fn()
            _reprocess_tied_embeddings(model)
        if group.device.type == "cuda":  # pragma: no cover - needs CUDA
            torch.cuda.synchronize()
        self._sonar_checksum = (int(version), sums.value)
        self._sonar_loaded = int(version)
        return {"rank": int(self.rank), "version": int(version), "total_s": time.perf_counter() - t0,
                "reload_misses_expected": misses.expected, "reload_misses": sorted(misses.other), **out}

    def _sonar_update_adapter(self, group: BroadcastGroup, version: int) -> dict:
        """``sonar_update`` of a LoRA run: receive the adapters (copied out of the bucket buffers), rank 0 writes
        them where the engine's ``LoRARequest`` points (module docstring)."""
        from sonar.cluster.wire.policy import write_adapter

        got: list[tuple[str, torch.Tensor]] = []
        sums = Checksum()
        t0 = time.perf_counter()
        out = group.recv_streamed(self._sonar_buckets, lambda named: got.extend((n, t.to("cpu", copy=True))
                                                                                for n, t in named), sums)
        lora = self._sonar_lora
        if int(self.rank) == 0:
            write_adapter(got, lora, lora["path"])
        self._sonar_checksum = (version, sums.value)
        self._sonar_loaded = version
        return {"rank": int(self.rank), "version": version, "total_s": time.perf_counter() - t0,
                "reload_misses_expected": 0, "reload_misses": [], **out}

    def sonar_checksum(self) -> dict:
        """``sonar.cluster.transport.weights.checksum`` of the tensors of the last complete push, summed as they
        arrived (None before any, or after a push that failed)."""
        got = getattr(self, "_sonar_checksum", None)
        return {"rank": int(self.rank), "version": None if got is None else got[0],
                "loaded": getattr(self, "_sonar_loaded", -1), "checksum": None if got is None else got[1]}


def _reprocess_tied_embeddings(model: torch.nn.Module) -> int:
    """Redo the post-load processing of every embedding-kind module that shares its weight with another
    module (a tied ``lm_head``); returns how many were redone.

    Why: vLLM's layerwise reload re-processes only the modules a checkpoint name loaded into. A tied
    ``lm_head`` loads nothing (its weight is ``embed_tokens``'s, and ``load_weights`` skips its name),
    yet on CPU its processing made a prepacked GEMM copy of that weight, so without this the logits
    would keep coming from the old embedding. The embedding method's processing only derives that copy
    (a no-op on GPU), so redoing it is safe; quantized methods are left alone."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, list[torch.nn.Module]] = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.nn.Parameter) and w.numel():
            owners.setdefault(id(w), []).append(mod)
    redone = 0
    for mods in owners.values():
        if len(mods) < 2:
            continue
        for mod in mods:
            method = getattr(mod, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(mod)
                redone += 1
    return redone


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_MISS = "%s: Failed to load weights"
"""vLLM 0.32's logger and message (``finalize_layerwise_processing``) for a layer that received nothing."""


def _unloadable_by_construction(model: torch.nn.Module) -> frozenset[str]:
    """Class names of the layers no push can load (module docstring): those with buffers and no
    parameters of their own, and every owner of a shared weight but the first (the one the checkpoint
    name loads: ``embed_tokens`` comes before ``lm_head`` in ``modules()``)."""
    names, seen = set(), set()
    for mod in model.modules():
        own = list(mod.parameters(recurse=False))
        if not own and next(mod.buffers(recurse=False), None) is not None:
            names.add(type(mod).__name__)
        for p in own:
            if id(p) in seen:
                names.add(type(mod).__name__)
            seen.add(id(p))
    return frozenset(names)


class _ReloadMisses(logging.Filter):
    """A filter on vLLM's reload logger while ``with misses:`` lasts: drops the "Failed to load weights"
    records of ``unloadable`` layers (counted in ``expected``) and lets every other through (their layer
    names kept in ``other``)."""

    def __init__(self, unloadable: frozenset[str]):
        super().__init__()
        self.unloadable, self.expected, self.other = unloadable, 0, set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != RELOAD_MISS or not record.args:
            return True
        layer = str(record.args[0])
        if layer in self.unloadable:
            self.expected += 1
            return False
        self.other.add(layer)
        return True

    def __enter__(self) -> "_ReloadMisses":
        logging.getLogger(RELOAD_LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(RELOAD_LOGGER).removeFilter(self)
