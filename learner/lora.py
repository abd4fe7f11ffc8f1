"""LoRA in the learner (``learner.lora``): the KL reference as a frozen adapter, and the merged export.

The policy is a peft model (``cluster/wire/policy.py: with_lora``): the base frozen, one trained adapter
(peft's ``default``) and, when a stage has a KL term, a frozen ``REFERENCE_ADAPTER`` of the same shape.
The reference policy is the base plus that adapter, so a stage's KL term pulls toward the policy at the
stage's start exactly as with full fine-tuning (where it is a frozen copy of the whole model), for the cost
of one adapter (``AdapterReference``).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from sonar.cluster.wire.policy import REFERENCE_ADAPTER


class AdapterReference(nn.Module):
    """The KL reference of a LoRA policy: ``policy``'s forward with its ``REFERENCE_ADAPTER`` in place of the
    trained one (peft's per-row ``adapter_names``, which needs eval mode; dropout is off in the reference
    either way), without gradient. Not a copy: the base and both adapters are the policy's own tensors."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self._policy = [policy]  # not a submodule: this wrapper holds no parameters of its own

    def get_base_model(self):  # ``policy.base_model``: where the output head and the trunk are
        return self._policy[0].get_base_model()

    def forward(self, input_ids: torch.Tensor, **kwargs):
        policy = self._policy[0]
        was = policy.training
        policy.eval()
        try:
            with torch.no_grad():
                return policy(input_ids=input_ids, adapter_names=[REFERENCE_ADAPTER] * input_ids.shape[0], **kwargs)
        finally:
            policy.train(was)


def set_reference(policy: nn.Module, zero3: bool, rank: int) -> int:
    """Copy the trained adapter's values into ``REFERENCE_ADAPTER`` (a stage with a KL term starts). Under
    ZeRO-3 both are gathered (every rank joins, rank 0 writes, the reference is re-partitioned from it).
    Returns the number of tensors copied."""
    import deepspeed

    params = dict(policy.named_parameters())
    pairs = [(params[n.replace(f".{REFERENCE_ADAPTER}.", ".default.")], q)
             for n, q in params.items() if f".{REFERENCE_ADAPTER}." in n]
    if not pairs:
        raise RuntimeError(f"the LoRA policy has no {REFERENCE_ADAPTER!r} adapter (built without a KL stage)")
    for p, q in pairs:
        ctx = (deepspeed.zero.GatheredParameters([p]) if zero3 else nullcontext())
        with ctx, (deepspeed.zero.GatheredParameters([q], modifier_rank=0) if zero3 else nullcontext()):
            if rank == 0 or not zero3:
                with torch.no_grad():
                    q.data.copy_(p.data)
    return len(pairs)


def merged(state: dict, lora) -> dict:
    """A peft state (``_param_state`` of the LoRA policy: ``base_model.model.<hf name>``, each target layer
    as ``base_layer`` and its adapters) as the Hugging Face model it serves: every adapted weight
    ``W + (alpha / r) B A`` (peft's merge, in the weight's dtype through float32), the reference adapter
    dropped, the names the base model's own."""
    prefix = "base_model.model."
    scale = lora.alpha / lora.rank
    out: dict = {}
    for name, t in state.items():
        if not name.startswith(prefix):
            raise ValueError(f"{name!r} is not a peft policy's parameter (no {prefix!r} prefix)")
        name = name[len(prefix):]
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            layer, leaf = name.split(".base_layer.")
            if leaf == "weight":
                a, b = state[f"{prefix}{layer}.lora_A.default.weight"], state[f"{prefix}{layer}.lora_B.default.weight"]
                t = (t.float() + scale * (b.float() @ a.float())).to(t.dtype)
            name = f"{layer}.{leaf}"
        out[name] = t
    return out
