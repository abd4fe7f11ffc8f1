"""Sonar's LearnerConfig -> a DeepSpeed config dict, and the LR schedule.

Pure (no DeepSpeed import). Gradient accumulation is driven by Sonar, not by DeepSpeed's fixed
``gradient_accumulation_steps``: micro-batches are packed by token budget, so their number varies
per step. DeepSpeed therefore runs with GAS=1 and the learner marks the accumulation boundary itself
(``set_gradient_accumulation_boundary``); each micro-batch loss is already normalised by the global
token count, so no further scaling is wanted.
"""
from __future__ import annotations

import math

from sonar.cluster.wire.config import LearnerConfig


def resolve_precision(cfg: LearnerConfig, on_gpu: bool) -> str:
    if cfg.precision == "auto":
        return "bf16" if on_gpu else "fp32"
    if cfg.precision == "bf16" and not on_gpu:
        raise ValueError("learner.precision='bf16' needs a GPU; use 'fp32' or 'auto' on CPU")
    return cfg.precision


def resolve_backend(cfg: LearnerConfig, on_gpu: bool) -> str:
    if cfg.dist_backend == "auto":
        return "nccl" if on_gpu else "gloo"
    if cfg.dist_backend == "nccl" and not on_gpu:
        raise ValueError("learner.dist_backend='nccl' needs a GPU; use 'gloo' or 'auto' on CPU")
    return cfg.dist_backend


def deepspeed_config(cfg: LearnerConfig, on_gpu: bool) -> dict:
    precision = resolve_precision(cfg, on_gpu)
    ds: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip if cfg.grad_clip > 0 else 0.0,
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        ds["bf16"] = {"enabled": True}
    if cfg.offload_optimizer:
        # DeepSpeed refuses a client torch optimizer with offload: its own AdamW (DeepSpeedCPUAdam over the
        # offloaded state) is built from this section; lr 0 is a placeholder (every step sets it).
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": 0.0, "betas": list(cfg.betas),
                                                       "weight_decay": cfg.weight_decay}}
    return ds


def uses_client_optimizer(cfg: LearnerConfig) -> bool:
    """Whether the learner passes its own torch AdamW to DeepSpeed (False: DeepSpeed builds its own from
    ``deepspeed_config``'s ``optimizer`` section, which optimizer offload needs)."""
    return not cfg.offload_optimizer


def lr_at(step: int, base_lr: float, warmup_steps: int, decay: str, total_steps: int) -> float:
    """Linear warmup over ``warmup_steps`` (step 0 gets lr/warmup), then constant/cosine/linear decay
    to 0 at ``total_steps``. ``step`` counts optimizer steps within the stage."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return base_lr
    frac = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "cosine":
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * frac))
    if decay == "linear":
        return base_lr * (1.0 - frac)
    raise ValueError(f"learner.lr_decay={decay!r} is not constant|cosine|linear")
