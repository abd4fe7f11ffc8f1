"""Sonar's LearnerConfig -> a DeepSpeed config dict, and the LR schedule.

Pure (no DeepSpeed import at module level; ``zero3_loading`` imports transformers' DeepSpeed integration
when it runs). Gradient accumulation is driven by Sonar, not by DeepSpeed's fixed
``gradient_accumulation_steps``: micro-batches are packed by token budget, so their number varies
per step. DeepSpeed therefore runs with GAS=1 and the learner marks the accumulation boundary itself
(``set_gradient_accumulation_boundary``); each micro-batch loss is already normalised by the global
token count, so no further scaling is wanted.
"""
from __future__ import annotations

import math
import sys
from contextlib import contextmanager

from sonar.cluster.wire.config import LearnerConfig


def resolve_precision(cfg: LearnerConfig, on_gpu: bool) -> str:
    """``learner.precision`` resolved: auto is bf16 on a GPU, fp32 on CPU. An explicit bf16 is kept on CPU
    too: DeepSpeed 0.19.8's CPU accelerator trains bf16 (measured: ZeRO 0, 2 and 3 step on CPU), which is
    how the bf16 paths (reference, critic, export dtypes) are tested without a GPU."""
    if cfg.precision == "auto":
        return "bf16" if on_gpu else "fp32"
    return cfg.precision


def train_dtype(cfg: LearnerConfig, on_gpu: bool) -> str:
    """The dtype the policy's parameters are held and computed in (a ``torch`` attribute name):
    bfloat16 under bf16 (DeepSpeed keeps the fp32 master copy inside its optimizer), else float32. The KL
    reference, the critic and the exports follow it."""
    return "bfloat16" if resolve_precision(cfg, on_gpu) == "bf16" else "float32"


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


def reference_config(cfg: LearnerConfig, on_gpu: bool) -> dict:
    """The DeepSpeed config of the frozen KL reference under ZeRO-3: an inference engine (no optimizer: no
    gradients, no master weights, no optimizer state) partitioned like the policy, in its precision, as
    OpenRLHF builds its reference. Only used with ``learner.zero_stage=3``; below it the reference is a
    plain module in the training dtype (ZeRO 0-2 keep full parameters on every rank anyway)."""
    ds: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if resolve_precision(cfg, on_gpu) == "bf16":
        ds["bf16"] = {"enabled": True}
    return ds


class _HfZeRO3:
    """What transformers reads of a registered DeepSpeed config (transformers 5.19,
    ``integrations/deepspeed.py``: ``is_deepspeed_zero3_enabled`` and ``deepspeed_config``)."""

    def __init__(self, config: dict):
        self.config = config

    def is_zero3(self) -> bool:
        return True


@contextmanager
def zero3_loading(ds_config: dict):
    """While open, transformers' ``from_pretrained`` builds the model inside ``deepspeed.zero.Init``
    (``ds_config``'s ZeRO-3 partitioning and dtype) and loads the checkpoint into the partitions, so no rank
    ever holds the whole model (without it every rank loads the full fp32 model and DeepSpeed partitions it
    afterwards). A no-op unless ``ds_config`` is ZeRO stage 3.

    transformers finds the config through a module-level weakref (``set_hf_deepspeed_config``) and reads
    only ``is_zero3()`` and ``config`` of it; ``HfDeepSpeedConfig`` would add a dependency on accelerate
    (it refuses to start without it, and Sonar does not install it), so ``_HfZeRO3`` stands in. It lives for
    the block only and the global is cleared after it, so a model built later in the process (a ZeRO-0
    learner, a test's plain model) is not partitioned by accident. ``zero.Init``'s
    memory-efficient linear, which transformers' call enables, replaces ``torch.nn.functional.linear``
    process-wide and never puts it back (DeepSpeed 0.19.8, ``_enable_mem_efficient_linear``); it is restored
    here, so the process's numerics do not depend on whether a ZeRO-3 model was loaded before (DeepSpeed's
    ZeRO-3 engine trains with the stock linear: the models it partitions itself never see the patch)."""
    if ds_config.get("zero_optimization", {}).get("stage") != 3:
        yield
        return
    import torch
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    linear = torch.nn.functional.linear
    keep = _HfZeRO3(ds_config)  # transformers holds only a weakref to it
    set_hf_deepspeed_config(keep)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        torch.nn.functional.linear = linear
        del keep


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


@contextmanager
def _unimportable(name: str):
    """``import name`` raises ImportError inside the block (``sys.modules[name] = None``), unless the
    module is loaded already; afterwards it imports normally again."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None
    try:
        yield
    finally:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


def import_deepspeed_without_shm_jit():
    """Import DeepSpeed with the shm comm op disabled (it JIT-compiles for ~90 s on first use), and
    without MLflow: DeepSpeed's autotuner (``deepspeed/autotuning/autotuner.py``, imported by
    ``deepspeed/__init__``) tries ``import mlflow`` for its own logging, which is 2-3 s of a learner
    process's start-up on a CPU core (measured: a smoke learner's construction 9.6 s -> 6.8 s). Sonar never
    runs the autotuner, and its learner logs nothing to MLflow (the driver does).

    Without CUDA, ``DS_ACCELERATOR=cpu`` (unless set): DeepSpeed's detection reaches the same answer but
    says so in a WARNING line of its own format at import ("Setting accelerator to CPU. If you have GPU
    ..."), the one line of a CPU run in another date format. Sonar runs on CUDA or CPU only. DeepSpeed's
    logger then gets the one date format of Sonar's logs (``cluster/wire/logs.py``)."""
    import os

    import torch

    from sonar.cluster.wire.logs import restamp

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    with _unimportable("mlflow"):
        import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (binds the module into sys.modules)
    restamp(("DeepSpeed",))

    mod = sys.modules["deepspeed.comm.torch"]
    if hasattr(mod, "build_shm_op"):
        mod.build_shm_op = lambda: None
    return deepspeed
