"""The learner ranks' collectives (the default process group), every tensor on the learner's device.

torch 2.13's NCCL process group has a CUDA backend only (``Backend.backend_capability["nccl"] ==
["cuda"]``): a collective on a CPU tensor raises ``No backend type associated with device type cpu``.
So every helper here takes the ``device`` the learner computes on (``engine.device``: ``cuda:N`` on a
GPU, ``cpu`` under gloo) and puts its tensors there. A gloo group serves both devices, which is why
CPU-only runs never showed it; a group initialised with the backend string ``"cuda:gloo"`` refuses CPU
tensors the way NCCL does (tests/learner/test_gpu_path.py).

``dp = (rank, world_size)`` as in ``train_step``; one rank skips the collective.

Torch only (no other Sonar module), so ``bench/gpu_check.py`` can load this file by path and run it
under a real NCCL group.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def dp_sum(x: float, dp: tuple[int, int], device: torch.device | str) -> float:
    """``x`` summed over the data-parallel ranks: one all-reduce of a float64 scalar on ``device``."""
    if dp[1] == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t[0])


def sum_disjoint_rows_(t: torch.Tensor, dp: tuple[int, int]) -> torch.Tensor:
    """All ranks' rows of ``t`` on every rank, in place: each rank filled its own rows and left the others
    exactly 0, so the sum over ranks is a gather (x + 0 is exact in floating point). ``t`` must be on the
    learner's device (an NCCL group refuses a CPU tensor) and have the same shape on every rank."""
    if dp[1] > 1:
        dist.all_reduce(t)
    return t


def broadcast_object(obj: Any, src: int, dp: tuple[int, int], device: torch.device | str) -> Any:
    """``obj`` of rank ``src`` on every rank (pickled into a byte tensor on ``device``: without ``device=``
    torch picks ``cuda`` for an NCCL-only group but ``cpu`` whenever a CPU backend is present)."""
    if dp[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=torch.device(device))
    return box[0]


def barrier(dp: tuple[int, int], device: torch.device | str) -> None:
    """Every rank waits for every other. On a CUDA device the barrier's all-reduce runs on that device
    (``device_ids``); without it NCCL guesses the current device and warns."""
    if dp[1] == 1:
        return
    device = torch.device(device)
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
    else:
        dist.barrier()
