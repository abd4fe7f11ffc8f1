"""The receiving end of the weight broadcast, inside each of vLLM's worker processes.

vLLM imports this class by its dotted name (``worker_extension_cls``) in every worker process it
starts (one per tensor-parallel rank; on CPU, one worker process beside the engine core) and mixes it
into its worker class, so ``self`` is vLLM's worker: ``self.rank`` is its rank in vLLM's own world
(the tensor-parallel rank here), ``self.model_runner`` holds the model. The engine (``VLLMEngine``)
calls these methods through ``collective_rpc``, which runs them on every rank.

Why here and not in the Ray actor: a tensor cannot cross ``collective_rpc`` (the engine core is
another process, and its msgpack encoder fails on tensors: "cannot pickle memoryview objects"), and
copying weights actor -> engine core -> worker would cost three copies of the model. So each vLLM
worker joins the learner's broadcast group itself (``sonar.cluster.wire.weights.BroadcastGroup``,
gloo on CPU, NCCL on GPU) and receives the buckets straight onto its device. Only names, shapes,
dtypes, addresses and version numbers travel by RPC.

Rank layout: the learner is rank 0; the rollout worker ``i`` owns ranks ``base_i .. base_i + tp - 1``
(``base_i`` from the driver, which counts every worker's ranks), and vLLM's rank ``r`` joins as
``base_i + r``. Every rank receives the full tensors; the model's ``load_weights`` (called by vLLM's
layerwise reload) cuts each rank's tensor-parallel shard and fuses q/k/v and gate/up itself.

Loading: ``model_runner.reload_weights(weights_iterator=...)`` -- vLLM's layerwise reload, the path
its own NCCL weight-transfer engine takes. It restores each layer's checkpoint-format parameters,
runs the model's own ``load_weights`` and then the post-load processing again. A plain second
``model.load_weights`` is not enough on CPU: vLLM prepacks linear weights for its GEMM kernels after
the first load and leaves parameters without a ``weight_loader`` behind.

Receive and load are separate calls so that the engine can receive while generation runs (the
transfer only fills buffers) and load while generation is paused. The receive buffers (one flat
tensor per bucket, the learner's bucket plan) are allocated once per group and reused; they also hold
exactly what was received, which is what :meth:`sonar_checksum` sums (a checksum over vLLM's own
parameters would see fused and prepacked tensors, not the learner's).

Imports: torch and ``sonar.cluster.wire`` only -- this module is imported inside vLLM's processes.
"""
from __future__ import annotations

import time

import torch

from sonar.cluster.wire.weights import BroadcastGroup, TensorSpec, checksum, layout_digest, plan_buckets


class SonarWorkerExtension:
    """Mixed into vLLM's worker class; every method runs on every vLLM rank (``collective_rpc``)."""

    def sonar_join(self, master_addr: str, master_port: int, rank_base: int, world_size: int, backend: str,
                   prefix: str, specs: list) -> dict:
        """Join the broadcast group as rank ``rank_base + self.rank``; blocks until every rank joined.

        ``specs``: ``[(name, shape, dtype name)]`` in the learner's order. Returns the rank and the
        layout digest, which the engine checks against the learner's."""
        self.sonar_leave()
        tspecs = [TensorSpec(str(n), tuple(int(x) for x in shape), getattr(torch, str(d))) for n, shape, d in specs]
        rank = int(rank_base) + int(self.rank)
        group = BroadcastGroup(master_addr, int(master_port), rank, int(world_size), backend, prefix=prefix)
        self._sonar_group = group
        self._sonar_buckets = plan_buckets(tspecs)
        self._sonar_buffers = group.alloc_buffers(self._sonar_buckets)
        self._sonar_received: tuple[int, dict] | None = None
        self._sonar_loaded = -1
        return {"rank": rank, "digest": layout_digest(tspecs), "device": str(group.device)}

    def sonar_leave(self) -> None:
        group = getattr(self, "_sonar_group", None)
        if group is not None:
            group.close()
        self._sonar_group = None
        self._sonar_buffers = None
        self._sonar_received = None

    def sonar_receive(self, version: int) -> dict:
        """Collective with the learner's ``send_weights``: every bucket into the reused buffers."""
        if getattr(self, "_sonar_group", None) is None:
            raise RuntimeError("sonar_receive before sonar_join: this vLLM worker is in no broadcast group")
        t0 = time.perf_counter()
        named = self._sonar_group.recv_weights(self._sonar_buckets, into=self._sonar_buffers)
        if self._sonar_group.device.type == "cuda":
            torch.cuda.synchronize()
        self._sonar_received = (int(version), named)
        return {"rank": int(self.rank), "version": int(version), "seconds": time.perf_counter() - t0,
                "bytes": sum(b.nbytes for b in self._sonar_buckets)}

    def sonar_load(self, version: int) -> dict:
        """Load the received tensors into the model. Generation must be paused (the engine does it)."""
        received = getattr(self, "_sonar_received", None)
        if received is None or received[0] != int(version):
            have = None if received is None else received[0]
            raise RuntimeError(f"sonar_load(version={version}): this vLLM worker received version {have}")
        t0 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(list(received[1].items())), is_checkpoint_format=True)
        _reprocess_tied_embeddings(self.model_runner.get_model())
        if self._sonar_group.device.type == "cuda":
            torch.cuda.synchronize()
        self._sonar_loaded = int(version)
        return {"rank": int(self.rank), "version": int(version), "seconds": time.perf_counter() - t0}

    def sonar_checksum(self) -> dict:
        """``sonar.cluster.wire.weights.checksum`` of the last tensors received (None before any)."""
        received = getattr(self, "_sonar_received", None)
        if received is None:
            return {"rank": int(self.rank), "version": None, "loaded": getattr(self, "_sonar_loaded", -1),
                    "checksum": None}
        return {"rank": int(self.rank), "version": received[0], "loaded": self._sonar_loaded,
                "checksum": checksum(received[1].items())}


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
