"""What a learner step talks to (``learner/train_step.py``): a ``Stepper`` has ``module``,
``backward(loss, boundary)`` and ``step() -> grad_norm``. ``DeepSpeedStepper`` wraps a DeepSpeed engine (the
learner actor, and the PPO critic's own engine); ``TorchStepper`` wraps a plain model + optimizer and is the
reference the DeepSpeed path is tested against. Its own module so that the critic (which train_step
imports) uses them without importing train_step."""
from __future__ import annotations

from typing import Protocol

import torch


class Stepper(Protocol):
    """Calling the stepper runs the forward pass: through the DeepSpeed engine, not its bare module,
    because the engine's forward advances ZeRO-3's micro-step counter (without it, micro-batch
    gradients overwrite instead of accumulating)."""

    module: torch.nn.Module

    def __call__(self, **inputs): ...

    def backward(self, loss: torch.Tensor, boundary: bool) -> None: ...

    def step(self) -> float: ...


class TorchStepper:
    """Plain PyTorch: gradients add up over micro-batches; clip; optimizer step; zero grads."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float):
        self.module, self.optimizer, self.grad_clip = module, optimizer, grad_clip

    def __call__(self, **inputs):
        return self.module(**inputs)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        loss.backward()

    def step(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))) if params else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


class DeepSpeedStepper:
    """DeepSpeed runs with gradient_accumulation_steps=1; Sonar marks the accumulation boundary
    itself because the number of token-packed micro-batches varies from step to step."""

    def __init__(self, engine, zero_stage: int):
        self.engine, self.zero_stage = engine, zero_stage
        self.module = engine.module

    def __call__(self, **inputs):
        return self.engine(**inputs)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss)

    def step(self) -> float:
        norm = None
        if self.zero_stage == 0:  # DeepSpeed reports no global norm without ZeRO; measure it first
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        self.engine.step()
        if norm is None:
            g = self.engine.get_global_grad_norm()
            norm = float(g) if g is not None else float("nan")
        return norm
