"""Trajectories -> padded tensors, and micro-batches packed by a token budget.

Notation: B sequences, T = longest trajectory in the batch (tokens). Token tensors that the loss
consumes are aligned to *predicted* tokens and have T-1 columns: column t belongs to token t+1,
which the model predicts from tokens <= t. So ``loss_mask[b, t] = 1`` iff token t+1 of sequence
b is a MODEL token, and ``behaviour_logprobs[b, t]`` is the sampling logprob of that token. This
is the same shift as ``losses.token_logprobs(logits, input_ids)`` -> [B, T-1]; doing it once here
means no caller ever shifts a mask by hand. (A MODEL token at position 0 would have no context and
is never trained; trajectories start with a PROMPT segment.)

Micro-batches: a batch larger than memory is split into micro-batches whose (rows x padded
length) fits ``LearnerConfig.micro_batch_tokens``. To get exactly the full-batch gradient, each
micro-batch loss must be normalised by the *global* counts (``Batch.denominators()`` of the full
batch, summed over DP ranks), not its own; the per-micro-batch losses then sum to the full-batch
loss. ``microbatch_loss_scale`` gives the factor for engines that average instead of summing.

Pure module: numpy, torch, cluster.protocol.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from sonar.cluster.wire.protocol import Trajectory
from sonar.learner.algo.losses import AggDenominators


@dataclass
class Batch:
    """A padded batch of trajectories (right padding)."""

    input_ids: Tensor
    """[B, T] long; ``pad_id`` after each sequence's end."""
    attention_mask: Tensor
    """[B, T] long; 1 on real tokens, 0 on padding."""
    loss_mask: Tensor
    """[B, T-1] float32; 1 iff the *predicted* token t+1 is a MODEL token."""
    behaviour_logprobs: Tensor
    """[B, T-1] float32; sampling logprob of token t+1 (0 where loss_mask is 0)."""
    versions: Tensor
    """[B, T-1] long; policy version that sampled token t+1 (-1 where loss_mask is 0)."""
    sample_weight: Tensor
    """[B] float32; ``Trajectory.weight`` (staleness downweight, 1 otherwise)."""
    rewards: Tensor
    """[B] float32; ``Trajectory.reward``."""
    group_index: Tensor
    """[B] long; dense 0..G-1 in order of first appearance of ``Trajectory.group_id``."""
    lengths: Tensor
    """[B] long; unpadded token count of each trajectory."""
    min_versions: Tensor
    """[B] long; ``Trajectory.min_version()`` (-1: no MODEL token)."""
    advantages: Tensor | None = None
    """[B, T-1] float32 per-sequence advantages broadcast over loss_mask, if given to ``collate``."""
    proximal_logprobs: Tensor | None = None
    """[B, T-1] float32: the learner's own logprobs at the start of the batch (no gradient), the fixed "old"
    policy of every epoch and mini-batch (``train_step.rl_step``); None when the batch takes one update."""
    old_values: Tensor | None = None
    """[B, T-1] float32 V_old of the critic (ppo), fixed for the batch; None otherwise."""
    returns: Tensor | None = None
    """[B, T-1] float32 value targets of the critic (ppo), fixed for the batch; None otherwise."""
    old_terminal_values: Tensor | None = None
    """[B] float32 V_old of the state after each row's last token where the critic trains it toward 0
    (``critic.trains_terminal_value``, RAG-R1's fork), NaN for the rows it does not; None when it trains none."""
    response_mask: Tensor | None = None
    """[B, T-1] float32; 1 iff the predicted token t+1 follows the prompt (MODEL or RETRIEVAL), the
    critic's tokens under ``critic.tokens='response'``; ``collate`` always sets it."""
    traj_ids: list[str] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def denominators(self) -> AggDenominators:
        """Aggregation counts of this batch (pass the full batch's to every micro-batch)."""
        return AggDenominators.from_mask(self.loss_mask)

    def select(self, indices: Sequence[int]) -> "Batch":
        """Rows ``indices`` (in that order), trimmed to their own longest sequence."""
        if len(indices) == 0:
            raise ValueError("Batch.select needs at least one index")
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        t = max(int(self.lengths[idx].max()), 1)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):
                out[f.name] = [v[i] for i in idx.tolist()] if v else []
            elif v is None:
                out[f.name] = None
            elif v.dim() == 1:
                out[f.name] = v[idx]
            elif f.name in ("input_ids", "attention_mask"):
                out[f.name] = v[idx, :t]
            else:
                out[f.name] = v[idx, :t - 1]
        return Batch(**out)

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(**{f.name: (getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), Tensor)
                                 else getattr(self, f.name)) for f in fields(self)})


def collate(trajs: list[Trajectory], advantages_per_traj: Sequence[float] | None = None, pad_id: int = 0) -> Batch:
    """Pad trajectories into a ``Batch`` (see the module docstring for the T-1 alignment).

    Args:
        trajs: B trajectories (order kept).
        advantages_per_traj: B sequence advantages (e.g. from ``group_advantages``) or None;
            broadcast over each sequence's ``loss_mask`` into ``Batch.advantages`` [B, T-1].
        pad_id: token id used for right padding (masked by attention_mask and loss_mask).
    """
    if not trajs:
        raise ValueError("collate needs at least one trajectory")
    if advantages_per_traj is not None and len(advantages_per_traj) != len(trajs):
        raise ValueError(f"advantages_per_traj has {len(advantages_per_traj)} entries for {len(trajs)} trajectories")
    b = len(trajs)
    lengths = [t.num_tokens() for t in trajs]
    T = max(max(lengths), 1)
    ids = np.full((b, T), pad_id, dtype=np.int64)
    attn = np.zeros((b, T), dtype=np.int64)
    lmask = np.zeros((b, T - 1), dtype=np.float32)
    rmask = np.zeros((b, T - 1), dtype=np.float32)
    blp = np.zeros((b, T - 1), dtype=np.float32)
    vers = np.full((b, T - 1), -1, dtype=np.int64)
    group_of: dict[str, int] = {}
    gidx = np.zeros(b, dtype=np.int64)
    for i, t in enumerate(trajs):
        n = lengths[i]
        if n == 0:
            continue
        ids[i, :n] = t.token_ids()
        attn[i, :n] = 1
        m = t.loss_mask()[1:].astype(np.float32)        # token t+1 is trained -> column t
        lmask[i, :n - 1] = m
        rmask[i, :n - 1] = t.response_mask()[1:]
        blp[i, :n - 1] = np.where(m > 0, t.behaviour_logprobs()[1:], 0.0)
        vers[i, :n - 1] = np.where(m > 0, t.versions()[1:], -1)
    for i, t in enumerate(trajs):
        gidx[i] = group_of.setdefault(t.group_id, len(group_of))
    adv = None
    if advantages_per_traj is not None:
        a = np.asarray(advantages_per_traj, dtype=np.float32)[:, None]
        adv = torch.from_numpy(np.where(lmask > 0, a, 0.0).astype(np.float32))
    return Batch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        loss_mask=torch.from_numpy(lmask),
        response_mask=torch.from_numpy(rmask),
        behaviour_logprobs=torch.from_numpy(blp),
        versions=torch.from_numpy(vers),
        sample_weight=torch.tensor([float(t.weight) for t in trajs], dtype=torch.float32),
        rewards=torch.tensor([float(t.reward) for t in trajs], dtype=torch.float32),
        group_index=torch.from_numpy(gidx),
        lengths=torch.tensor(lengths, dtype=torch.long),
        min_versions=torch.tensor([t.min_version() for t in trajs], dtype=torch.long),
        advantages=adv,
        traj_ids=[t.traj_id for t in trajs],
        group_ids=[t.group_id for t in trajs],
    )


def pack_micro_batches(items: Sequence[Trajectory] | Sequence[int], token_budget: int) -> list[list[int]]:
    """Group indices into micro-batches with rows x (longest length) <= token_budget.

    ``items``: trajectories or their token lengths. Indices are sorted by length, longest first
    (ties by index, so the result is deterministic), and filled greedily: similar lengths share a
    micro-batch, which minimises padding. A sequence longer than the budget forms its own
    micro-batch (it cannot be split: its tokens attend to each other). Every index appears exactly
    once; within a micro-batch indices are in that sorted order.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget} must be >= 1")
    lengths = [it.num_tokens() if isinstance(it, Trajectory) else int(it) for it in items]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        n = max(lengths[i], 1)
        new_max = max(cur_max, n)
        if cur and new_max * (len(cur) + 1) > token_budget:
            out.append(cur)
            cur, new_max = [], n
        cur.append(i)
        cur_max = new_max
    if cur:
        out.append(cur)
    return out


def microbatch_loss_scale(dp_world_size: int = 1, grad_accum_steps: int = 1) -> float:
    """Factor to multiply each micro-batch loss by, so the optimizer sees the full-batch gradient.

    Precondition: every micro-batch loss was aggregated with the *global* ``AggDenominators``
    (full batch, summed over DP ranks), so these losses sum to the global loss. Then:
      * a plain loop that calls ``loss.backward()`` per micro-batch (gradients add up), single
        process: scale 1;
      * DP engines average gradients over ranks (DDP / DeepSpeed divide by world size): scale
        ``dp_world_size``;
      * DeepSpeed also divides each micro-batch loss by ``gradient_accumulation_steps`` in
        ``engine.backward`` (scale_wrt_gas): pass that number as ``grad_accum_steps``.
    Returns ``dp_world_size * grad_accum_steps``.
    """
    if dp_world_size < 1 or grad_accum_steps < 1:
        raise ValueError(f"dp_world_size={dp_world_size} and grad_accum_steps={grad_accum_steps} must be >= 1")
    return float(dp_world_size * grad_accum_steps)


def shard_rows(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Rows of a batch split across ``world_size`` data-parallel ranks, balanced by token count:
    longest first (ties by index), each to the rank holding the fewest tokens so far (ties: the lowest
    rank). Deterministic, so every rank computes the same split from the same batch; each rank's rows
    are in ascending order; a rank gets no rows only when there are fewer rows than ranks."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    lengths = [int(n) for n in lengths]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        shards[r].append(i)
        load[r] += max(lengths[i], 1)
    return [sorted(s) for s in shards]


def rank_packs(lengths: Sequence[int], token_budget: int, dp: tuple[int, int] = (0, 1)) -> list[tuple[list[int], bool]]:
    """This data-parallel rank's micro-batches of a batch whose rows have ``lengths``: (row indices, real).

    ``dp = (rank, world_size)``. One rank: ``pack_micro_batches`` of every row, all real. More: the rows are
    split by token count (``shard_rows``, the same split on every rank), each rank packs its own rows, and a
    rank with fewer micro-batches than the most loaded one gets filler micro-batches (one of its rows, or row 0
    when it has none; ``real`` False) until every rank has the same number: ZeRO's collectives (ZeRO-3's
    parameter gathers in every forward, ZeRO-1/2's gradient reduce-scatters) then pair up across the ranks.
    A filler's result must be discarded (its loss multiplied by 0, its logprobs not written)."""
    rank, world = dp
    if world == 1:
        return [(idx, True) for idx in pack_micro_batches(lengths, token_budget)]
    lengths = [int(n) for n in lengths]
    shards = shard_rows(lengths, world)
    packs = [[[s[j] for j in idx] for idx in pack_micro_batches([lengths[i] for i in s], token_budget)] if s else []
             for s in shards]
    n = max(1, max(len(p) for p in packs))
    filler = [shards[rank][0] if shards[rank] else 0]
    return [(rows, True) for rows in packs[rank]] + [(filler, False)] * (n - len(packs[rank]))
