"""The sync step's deadline against the batch and the model: is ``cluster.step_timeout_s`` clearly too small?

In sync mode one ``cluster.step_timeout_s`` bounds the generation of a whole batch (the driver's
``generate_groups`` call). A deadline must cover the longest batch the config allows, or a run can fail on
legitimate work; this module computes a **floor** of that batch's decode time on a fast GPU, and
``config.validate`` refuses a timeout below it (``_check_memory``), naming the figures.

The floor, per engine (``rollout.num_workers`` engines share the batch evenly):

    rows      = ceil(learner.groups_per_step x rollout.group_size / engines)
    waves     = ceil(rows / rollout.max_batch_rows)             (rows an engine decodes at once)
    steps     = min(protocol.max_turns x protocol.max_new_tokens_per_turn, protocol.max_total_tokens)
                                                                  (decode steps of the longest legal trajectory)
    step_ms   = T0_MS x weight bytes / REF_WEIGHT_BYTES / tp      (the weight read)
              + live rows x mean context / 1000 x MS_PER_1K_CTX x KV bytes per token / REF_KV_BYTES / tp
                                                                  (the KV-cache read, mean context steps / 2)
    floor_s   = waves x steps x step_ms / 1000

The coefficients are the H100 fit of ``bench/sim/gpu_cost.py`` (Mistral-7B under vLLM, 14.5 GB of bf16
weights, 128 KiB of KV per token; LambdaLabsML/vllm-benchmark's raw results, the source named there): a
decode step of a memory-bound model reads its weights and every running row's KV cache, scaled here by the
run's own model (``memory.ModelShape``) and tensor parallelism. It is a floor of the *worst legal* batch,
not an estimate of a typical one: prompts, documents, prefills, retrieval and the per-row work are left
out, and an H100 is assumed. Below it the deadline would cut a batch the config allows; above it the
timeout may still be short for a slower GPU.

Pure arithmetic on the config and the shape (no torch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

T0_MS = 6.6955
"""ms per decode step with no rows: the weight read of the reference model (bench/sim/gpu_cost.py T0_MS)."""
MS_PER_1K_CTX = 0.0923
"""ms per 1,000 context tokens summed over the step's rows: the KV read (bench/sim/gpu_cost.py MS_PER_1K_CTX)."""
REF_WEIGHT_BYTES = 14.5e9
"""The reference model's bf16 weights (Mistral-7B-v0.3, 7.25B parameters)."""
REF_KV_BYTES = 131_072
"""The reference model's KV bytes per token: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B."""


@dataclass(frozen=True)
class SyncFloor:
    """The floor of one sync batch's decode time per engine (module docstring) and its parts."""

    seconds: float
    rows: int
    waves: int
    steps: int
    step_ms: float

    def text(self) -> str:
        return (f"{self.rows:,} rows per engine in {self.waves} wave(s) of up to {self.steps:,} decode steps at "
                f">= {self.step_ms:.1f} ms each (weight and KV-cache reads on an H100): {self.seconds:,.0f} s")


def sync_batch_floor(cfg, weight_bytes: float, kv_bytes_per_token: float) -> SyncFloor:
    """The floor for ``cfg`` (duck-typed Config) with a model of ``weight_bytes`` in the engine's dtype and
    ``kv_bytes_per_token`` (all layers, K and V, the engine's dtype, before tensor parallelism)."""
    r, p = cfg.rollout, cfg.protocol
    engines = max(1, int(r.num_workers))
    tp = max(1, int(r.tensor_parallel_size))
    rows = math.ceil(cfg.learner.groups_per_step * r.group_size / engines)
    waves = math.ceil(rows / r.max_batch_rows)
    live = min(rows, r.max_batch_rows)
    steps = min(p.max_turns * p.max_new_tokens_per_turn, p.max_total_tokens)
    weight_ms = T0_MS * weight_bytes / REF_WEIGHT_BYTES / tp
    kv_ms = live * (steps / 2) / 1000 * MS_PER_1K_CTX * kv_bytes_per_token / REF_KV_BYTES / tp
    step_ms = weight_ms + kv_ms
    return SyncFloor(waves * steps * step_ms / 1000, rows, waves, steps, step_ms)
