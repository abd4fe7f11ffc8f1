"""Memory-bounded token logprobs and entropy: the output projection applied chunk by chunk.

The unchunked path (``losses.token_logprobs`` on ``model(...).logits``) holds the float32 logits of a
whole micro-batch, [N, V] for N tokens and a V-token vocabulary, for the backward pass; with
N = 32,768 and V = 151,936 that is 18.5 GiB before the log-softmax and entropy temporaries. Here the
final hidden states [N, H] (H << V) are split into chunks of ``chunk_tokens`` tokens and each chunk
runs ``head -> float32 -> /temperature -> logprob of the taken token (and entropy)`` on its own, under
``torch.utils.checkpoint`` when a gradient is wanted: the autograd graph keeps only the chunk's hidden
states (views of the tensor the trunk keeps anyway) and the targets, and the backward pass recomputes
one chunk's logits at a time. So at most ``chunk_tokens x V`` logits (plus the per-chunk softmax
temporaries) exist at once, in the forward and in the backward.

Results equal the unchunked path's (the same float32 formulas: ``losses.token_logprobs`` and
``losses.entropy_from_logits`` call ``scaled_logprobs`` / ``scaled_entropy`` defined here), up to the reduction order of the projection's matmul (tests pin 1e-6 in fp32,
gradients of every parameter included). ``head`` is the model's output-embedding *module* (called, not
its weight read), so ZeRO-3's parameter-fetch hooks gather it for every chunk and its recomputation.

Pure: torch only, no other Sonar module (no Ray, no DeepSpeed), so ``bench/gpu_check.py`` loads this
file by path on a machine with nothing but torch.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint



def scaled_logprobs(z: Tensor, target: Tensor) -> Tensor:
    """Scaled float32 logits [..., V], target ids [...] -> logprob of the target: gather - logsumexp [...]."""
    return z.gather(-1, target.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def scaled_entropy(z: Tensor) -> Tensor:
    """Scaled float32 logits [..., V] -> entropy [...]; -inf logits (banned tokens) contribute 0."""
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    # mask -inf before the product: 0 * -inf would be NaN in the forward and in the backward
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(dim=-1)


def _chunk(head: Callable[[Tensor], Tensor], h: Tensor, target: Tensor, temperature: float,
           with_entropy: bool, entropy_grad: bool) -> tuple[Tensor, Tensor]:
    z = head(h).float()
    if temperature != 1.0:
        z = z / temperature
    lp = scaled_logprobs(z, target)
    if not with_entropy:
        return lp, lp.new_zeros(())
    if entropy_grad:
        return lp, scaled_entropy(z)
    with torch.no_grad():
        return lp, scaled_entropy(z.detach())


def chunked_logprobs(hidden: Tensor, head: Callable[[Tensor], Tensor], input_ids: Tensor,
                     temperature: float = 1.0, chunk_tokens: int = 1024, with_entropy: bool = False,
                     entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """Logprobs of the realised next tokens and (optionally) the entropy, aligned like
    ``losses.token_logprobs``: hidden [B, T, H] (the final, post-norm hidden states), input_ids [B, T]
    -> ([B, T-1] float32, [B, T-1] float32 or None).

    out[b, t] = log_softmax(head(hidden[b, t]) / temperature)[input_ids[b, t+1]]. The B*(T-1) predicting
    positions are flattened and cut into chunks of ``chunk_tokens`` (the last may be shorter); each
    chunk is checkpointed when grad is enabled. ``entropy_grad=False``
    computes the entropy without a graph (a metric); True lets its gradient flow like the logprobs'.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: logprobs need a temperature > 0 (greedy has none)")
    if chunk_tokens < 1:
        raise ValueError(f"learner.logits_chunk_tokens={chunk_tokens} must be >= 1 to chunk (0 means unchunked)")
    if hidden.dim() != 3 or input_ids.shape != hidden.shape[:2]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [B, T, H] and input_ids {tuple(input_ids.shape)} [B, T]")
    b, t, d = hidden.shape
    flat = hidden[:, :-1].reshape(b * (t - 1), d)
    target = input_ids[:, 1:].reshape(-1).long()
    grad = torch.is_grad_enabled()  # the head's weight may need a gradient even if hidden does not
    lps, ents = [], []
    for s in range(0, flat.shape[0], chunk_tokens):
        h, y = flat[s:s + chunk_tokens], target[s:s + chunk_tokens]
        if grad:
            lp, ent = checkpoint(_chunk, head, h, y, temperature, with_entropy, entropy_grad,
                                 use_reentrant=False, preserve_rng_state=False)
        else:
            lp, ent = _chunk(head, h, y, temperature, with_entropy, entropy_grad)
        lps.append(lp)
        ents.append(ent)
    empty = hidden.new_zeros((0,), dtype=torch.float32)
    lp = (torch.cat(lps) if lps else empty).reshape(b, t - 1)
    ent = (torch.cat(ents) if ents else empty).reshape(b, t - 1) if with_entropy else None
    return lp, ent
