"""Values of the config resolved from several fields, used by the checks in config.py and by the memory
plan (memory.py), which config.py calls: kept here so neither imports the other's module for them.
Duck-typed over the ``Config`` dataclasses (no import of config.py)."""
from __future__ import annotations


def engine_dtype(cfg: Config) -> str:
    """``rollout.vllm_dtype`` resolved: ``auto`` is the learner's precision (see the field)."""
    d = cfg.rollout.vllm_dtype
    if d != "auto":
        return d
    L = cfg.learner
    return "bfloat16" if L.precision == "bf16" or (L.precision == "auto" and L.num_gpus > 0) else "float32"


def broadcast_backend(cfg: Config) -> str:
    """The weight push's backend. Split placement: NCCL only when every rank of the group (the learner and
    every rollout worker) has a GPU and learner.dist_backend allows it; gloo otherwise (CPU tensors; a GPU
    learner copies its buckets to host memory first). Colocated placement (``cluster.placement``): the
    hand-over on the device the learner and its engine share, ``cuda_ipc`` on GPU, ``shm`` (shared
    memory) on CPU (``cluster/transport/handover.py``)."""
    L = cfg.learner
    if getattr(cfg.cluster, "placement", "split") == "colocated":
        return "cuda_ipc" if L.num_gpus > 0 else "shm"
    if L.dist_backend == "gloo":
        return "gloo"
    return "nccl" if L.num_gpus > 0 and cfg.rollout.num_gpus_per_worker > 0 else "gloo"


COLOCATED_GPU_SHARE = 0.5
"""Ray's accounting of one shared GPU in colocated placement: the learner rank and the engine that take turns
on it each ask for this much of their common bundle (``{GPU: 1}``), so Ray puts both on the same device.
Accounting only: each uses the whole GPU in its turn (the memory plan counts both, phase by phase)."""


def colocated_on_gpu(cfg: Config) -> bool:
    """Colocated placement with GPUs: each learner rank's bundle also holds one rollout worker."""
    return getattr(cfg.cluster, "placement", "split") == "colocated" and cfg.learner.num_gpus > 0


def ray_gpus(cfg: Config, role: str) -> float:
    """Ray GPUs one actor of ``role`` ("learner": a rank; "rollout": a worker) asks for: its config field
    (``learner.num_gpus``, ``rollout.num_gpus_per_worker``), or :data:`COLOCATED_GPU_SHARE` of the bundle it
    shares in colocated placement on GPUs."""
    if colocated_on_gpu(cfg):
        return COLOCATED_GPU_SHARE
    return float(cfg.learner.num_gpus if role == "learner" else cfg.rollout.num_gpus_per_worker)


def vllm_batched_tokens(cfg: Config, on_gpu: bool | None = None) -> int:
    """vLLM's ``max_num_batched_tokens`` per engine step (``rollout.vllm_max_num_batched_tokens``, else
    derived, see the field): on GPU ``max_batch_rows + max_total_tokens`` (every running row decodes a token
    and one longest prefill fits beside them), on CPU ``max(max_total_tokens, 4096)`` (chunked prefill off).
    ``on_gpu``: where the engine runs (None: ``rollout.num_gpus_per_worker > 0``)."""
    r = cfg.rollout
    if r.vllm_max_num_batched_tokens:
        return int(r.vllm_max_num_batched_tokens)
    gpu = r.num_gpus_per_worker > 0 if on_gpu is None else on_gpu
    longest = int(cfg.protocol.max_total_tokens)
    return int(r.max_batch_rows) + longest if gpu else max(longest, 4096)
