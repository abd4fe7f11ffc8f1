"""Generation engines behind one interface: token ids in, token ids and sampling logprobs out.

The interface fits both the transformers engine (CPU and GPU, defined here) and vLLM
(``engine_vllm.py``, GPU only):

- ``generate(prompts, params)``: one ``Generation`` per prompt, in order. Stops on any id in
  ``params.stop_token_ids`` (the stop token is included in the output) or after ``max_new_tokens``.
- Logprobs are those of the *sampling* distribution: raw logits / temperature, full vocabulary
  (no top-k), so the learner recomputes the same numbers. Greedy (temperature 0) reports the
  logprob of the argmax under the temperature-1 distribution.
- ``load_weights(named_tensors)`` swaps weights by name; ``parameter_specs()`` gives the order,
  shapes and dtypes the weight-broadcast buckets follow.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass
class Generation:
    token_ids: np.ndarray
    """int32 [n], the stop token included when finish == 'stop'."""
    logprobs: np.ndarray
    """float32 [n]"""
    finish: str
    """'stop' | 'length'"""
    version: int
    """Policy version of the weights that sampled these tokens (weights swap only between calls)."""
    stop_token_id: int | None = None


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class Engine(Protocol):
    version: int

    def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams) -> list[Generation]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def parameter_specs(self) -> list[ParamSpec]: ...

    def state_checksum(self) -> float: ...
