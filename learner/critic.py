"""PPO's value model: V(s_t) for every predicted token, its optimizer, its checkpoint; no Ray.

Two shapes (``critic.mode``):

* ``separate`` (default; what veRL and RAG-R1 run): a second copy of the policy loaded from the policy
  directory, its trunk kept and its LM head replaced by a scalar head ``Linear(hidden, 1)``. The trunk
  and the head train together under the critic's own AdamW (``critic.lr``).
* ``head``: a scalar head on the policy's own trunk. The trunk's last hidden states are read without
  gradient, so the value loss trains only the head and the policy is trained by the policy loss alone
  (upstream "shared" critics add ``vf_coef * value_loss`` to the policy's loss instead; Sonar keeps the
  two optimizers apart so the policy's step is the same whatever the critic does). Costs one extra
  trunk forward per micro-batch and no second model.

What trains (``ValueModel``: the separate trunk, or nothing, plus the head) runs one of two ways:

* given ``ds_config`` (the learner passes its own DeepSpeed config): a DeepSpeed engine like the policy,
  the same ZeRO stage and precision (under ZeRO-3 the separate trunk is loaded straight into its
  partitions, ``deepspeed_config.zero3_loading``), its own AdamW at ``critic.lr``, gradients averaged over
  the data-parallel ranks (each rank trains its shard of every mini-batch), checkpointed through
  DeepSpeed's save/load (``CRITIC_DIR``; every rank writes its partition);
* without: a plain module and torch AdamW on one rank (the reference the DeepSpeed path is tested against).

The head starts at zero (weight and bias), so the first values are 0 and the first GAE advantages
are the plain returns; veRL initialises its score head randomly. Its learning rate is constant (veRL
warms the critic's up over 1.5 % of training in RAG-R1's script).

Notation: B sequences, T tokens; values are [B, T-1], column t = V of the state "tokens <= t", the
state in which token t+1 is chosen (aligned with ``Batch.loss_mask``).

The state after the last token (``trains_terminal_value``: on with ``critic.tokens='response'``, RAG-R1's
preset). RAG-R1's veRL fork (and Search-R1's) reads its values on the response grid shifted by one and
masks them, and the value loss, with ``attention_mask[:, -R-1:-1]``, while GAE and whitening use
``attention_mask[:, -R:]``; so for every response shorter than the batch's longest it also trains the value
of the state after the last token, toward its GAE return, which is exactly 0 (``terminal_rows``). Sonar does
the same there: that state joins the recursion and the value loss (its V_old on
``Batch.old_terminal_values``), never the whitening or the policy loss. With RAG-R1's gamma = lam = 1 the
advantages are unchanged (the terminal value cancels); the critic gets one more target per row, and the
value loss's token mean counts it. Current veRL masks values with the response mask: no such state.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor, nn

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import CriticConfig, LearnerConfig
from sonar.learner.algo.gae import explained_variance, gae, masked_whiten, outcome_token_rewards, value_loss
from sonar.learner.batching import Batch, microbatch_loss_scale, rank_packs
from sonar.learner.collectives import dp_sum, sum_disjoint_rows_

CRITIC_FILE = "critic.pt"
"""In a checkpoint directory: the critic's manifest (mode, steps, format) and, for a plain-torch critic,
its whole state (trunk, head, optimizer); a DeepSpeed critic keeps its parameters and optimizer in
``CRITIC_DIR``."""
CRITIC_DIR = "critic"
"""In a checkpoint directory: the DeepSpeed critic engine's state (tag ``engine``, every rank's partition)."""


def trunk_of(model: nn.Module, required: bool = True) -> nn.Module | None:
    """The decoder stack of a Hugging Face causal LM (``model.model`` for Llama/Qwen), without its head, under
    a peft wrapper too (``base_model``). None when there is none and not ``required``."""
    from sonar.cluster.wire.policy import base_model

    model = base_model(model)
    prefix = getattr(model, "base_model_prefix", "")
    trunk = getattr(model, prefix, None) if prefix else None
    if not isinstance(trunk, nn.Module):
        if not required:
            return None
        raise ValueError(f"cannot find the trunk of {type(model).__name__} (base_model_prefix={prefix!r})")
    return trunk


class ValueModel(nn.Module):
    """What the critic trains, as one module (so DeepSpeed can wrap it): ``trunk`` (critic.mode=separate,
    its own decoder stack) or None (mode=head: ``forward`` is given the policy trunk's detached last hidden
    states), and the scalar ``head``. Returns [b, t-1] float32 values."""

    def __init__(self, trunk: nn.Module | None, head: nn.Linear):
        super().__init__()
        self.trunk = trunk
        self.head = head

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                hidden: Tensor | None = None) -> Tensor:
        """[b, t] float32: the value of every state "tokens <= t", the last one (after the final token)
        included; ``Critic.values`` drops it, the terminal value (``terminal_value``) reads it."""
        if self.trunk is not None:
            hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        # the head computes in the module's dtype (bf16 under a bf16 engine, float32 otherwise)
        return self.head(hidden.to(self.head.weight.dtype)).float().squeeze(-1)


class Critic:
    """``values`` / ``predict`` (no grad) and ``update`` (one optimizer step over a batch).

    ``ds_config``: a DeepSpeed config (the learner's ``deepspeed_config``) to run the value model as a
    DeepSpeed engine (ZeRO stage, precision and optimizer offload as there; the critic's lr replaces the
    config's placeholder); None: plain PyTorch on ``device``, one rank."""

    def __init__(self, cfg: CriticConfig, lcfg: LearnerConfig, *, policy_dir: str | None = None,
                 policy_module: nn.Module | None = None, device: torch.device | str = "cpu",
                 ds_config: dict | None = None):
        from sonar.learner.deepspeed_config import zero3_loading
        from sonar.learner.steppers import DeepSpeedStepper, TorchStepper

        self.cfg, self.lcfg, self.device = cfg, lcfg, torch.device(device)
        # the engine's dtype from the start: ZeRO-3 partitions the head beside a trunk that zero.Init built in
        # that dtype, and one partition group holds one dtype
        bf16 = bool((ds_config or {}).get("bf16", {}).get("enabled"))
        self.policy_trunk = None  # mode=head: the policy's own trunk, read without gradient
        if cfg.mode == "separate":
            if policy_dir is None:
                raise ValueError("critic.mode='separate' needs the policy directory to initialise from")
            from sonar.cluster.wire.policy import load_policy

            with zero3_loading(ds_config or {}):  # ZeRO-3: built inside zero.Init, loaded into its partitions
                model, _ = load_policy(policy_dir, dtype=torch.bfloat16 if bf16 else None)
            trunk = trunk_of(model)
            hidden = model.config.hidden_size
            del model  # the LM head is not kept
        elif cfg.mode == "head":
            if policy_module is None:
                raise ValueError("critic.mode='head' needs the policy module whose trunk it reads")
            self.policy_trunk = trunk_of(policy_module)
            trunk = None
            hidden = policy_module.config.hidden_size
        else:
            raise ValueError(f"critic.mode={cfg.mode!r} is not separate|head")
        head = nn.Linear(hidden, 1, dtype=torch.bfloat16 if bf16 else torch.float32)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        self.model = ValueModel(trunk, head)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        betas = tuple(lcfg.betas)
        if ds_config is None:
            self.model.to(self.device)
            self.engine = None
            self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=betas, weight_decay=lcfg.weight_decay)
            self.stepper = TorchStepper(self.model, self.optimizer, lcfg.grad_clip)
        else:
            from sonar.learner.deepspeed_config import import_deepspeed_without_shm_jit as _import_deepspeed_without_shm_jit

            deepspeed = _import_deepspeed_without_shm_jit()
            ds = copy.deepcopy(ds_config)
            opt = None
            if "optimizer" in ds:  # optimizer offload: DeepSpeed's own AdamW, built from the config
                ds["optimizer"]["params"]["lr"] = cfg.lr
            else:
                opt = torch.optim.AdamW(params, lr=cfg.lr, betas=betas, weight_decay=lcfg.weight_decay)
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=self.model, optimizer=opt, model_parameters=params if opt is None else None, config=ds)
            self.device = self.engine.device
            self.stepper = DeepSpeedStepper(self.engine, int(ds["zero_optimization"]["stage"]))
        self.steps = 0

    @property
    def head(self) -> nn.Linear:
        return self.model.head

    @property
    def trunk(self) -> nn.Module:
        """The trunk the values are computed from: the critic's own (separate) or the policy's (head)."""
        return self.model.trunk if self.policy_trunk is None else self.policy_trunk

    # ------------------------------------------------------------------ forward
    def values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[b, t-1] float32 values of a (micro-)batch; differentiable in the critic's own parameters."""
        return self.all_values(input_ids, attention_mask)[:, :-1]

    def all_values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[b, t] float32: ``values`` and, in column t-1, the value of the state after the last token;
        a row shorter than t has its own terminal state in column ``length - 1``."""
        if self.policy_trunk is not None:
            with torch.no_grad():
                hidden = self.policy_trunk(input_ids=input_ids, attention_mask=attention_mask,
                                           use_cache=False).last_hidden_state
            return self.stepper(hidden=hidden.detach())
        return self.stepper(input_ids=input_ids, attention_mask=attention_mask)

    def mask(self, batch: Batch) -> Tensor:
        """[B, T-1] the critic's tokens (``critic.tokens``): the loss mask (``model``) or every token after
        the prompt (``response``, RAG-R1's fork)."""
        if self.cfg.tokens == "response":
            if batch.response_mask is None:
                raise ValueError("critic.tokens='response' needs Batch.response_mask (made by batching.collate)")
            return batch.response_mask
        return batch.loss_mask

    @torch.no_grad()
    def predict(self, batch: Batch, dp: tuple[int, int] = (0, 1)) -> Tensor:
        """V_old: [B, T-1] float32 (on CPU) for the whole batch, 0 off the critic's tokens (``mask``). ``dp``: each rank
        forwards its shard of the rows and the ranks' rows are summed on the device (as
        ``train_step.batch_logprobs``)."""
        return self.predict_all(batch, dp)[0]

    @torch.no_grad()
    def predict_all(self, batch: Batch, dp: tuple[int, int] = (0, 1)) -> tuple[Tensor, Tensor]:
        """(``predict``'s V_old [B, T-1], the value of the state after each row's last token [B]), float32 on
        CPU, from one forward."""
        B, T = batch.input_ids.shape
        out = torch.zeros((B, T), dtype=torch.float32, device=self.device)
        for idx, real in rank_packs(batch.lengths.tolist(), self.lcfg.micro_batch_tokens, dp):
            mb = batch.select(idx).to(self.device)
            v = self.all_values(mb.input_ids, mb.attention_mask)
            if real:
                out[torch.as_tensor(idx, device=self.device)[:, None],
                    torch.arange(v.shape[1], device=self.device)[None, :]] = v
        out = sum_disjoint_rows_(out, dp).cpu()
        terminal = out[torch.arange(B), (batch.lengths - 1).clamp(min=0)]
        old = out[:, :-1]
        return torch.where(self.mask(batch) > 0, old, torch.zeros_like(old)), terminal

    # ------------------------------------------------------------------ update
    def update(self, batch: Batch, old_values: Tensor, returns: Tensor,
               dp: tuple[int, int] = (0, 1)) -> dict[str, float]:
        """One optimizer step on the clipped value loss over ``batch`` (micro-batched; every micro-batch
        divides by the batch's token count, so the gradients sum to the full-batch one), gradient norm
        clipped at ``learner.grad_clip``. Returns the value loss, its clip fraction, the means of
        V_old and of the returns, explained_variance (of V_old) and grad_norm, keyed by
        ``K.LEARNER_CRITIC_*``. ``old_values`` and ``returns`` are [B, T-1] for the whole batch.

        ``dp = (rank, world_size)``: each rank trains its share of the rows (``batching.rank_packs``, fillers
        multiplied by 0), its losses multiplied by ``world_size`` because DeepSpeed averages the ranks'
        gradients; the logged loss and clip fraction are the whole batch's."""
        if dp[1] > 1 and self.engine is None:
            raise ValueError(f"a plain-PyTorch critic trains on one rank, not dp={dp}: pass ds_config")
        terminal = batch.old_terminal_values
        tokens = float((self.mask(batch) > 0).sum()) + (0.0 if terminal is None else float(terminal.isfinite().sum()))
        loss_total, clip_sum = 0.0, 0.0
        packs = rank_packs(batch.lengths.tolist(), self.lcfg.micro_batch_tokens, dp)
        self.model.train()
        for i, (idx, real) in enumerate(packs):
            mb = batch.select(idx).to(self.device)
            w = mb.loss_mask.shape[1]
            rows = torch.as_tensor(idx)
            old = old_values[rows, :w].to(self.device)
            ret = returns[rows, :w].to(self.device)
            # every state of the micro-batch (column w: after the longest row's last token), and the terminal
            # states the fork trains (target 0, clipped around their V_old like every other value)
            v = self.all_values(mb.input_ids, mb.attention_mask)
            v, old, ret, mb_mask = _with_terminal_states(
                v, old, ret, self.mask(mb), None if terminal is None else terminal[rows].to(self.device), mb.lengths)
            out = value_loss(v, old, ret, mb_mask, self.cfg.value_clip, tokens=tokens)
            scale = (microbatch_loss_scale(dp_world_size=dp[1]) if real else 0.0) if dp[1] > 1 else 1.0
            self.stepper.backward(out.loss * scale if dp[1] > 1 else out.loss, boundary=i == len(packs) - 1)
            if real:
                loss_total += float(out.loss.detach())
                clip_sum += out.metrics["value_clipfrac"] * float((mb_mask > 0).sum())
        loss_total = dp_sum(loss_total, dp, self.device)
        clip_sum = dp_sum(clip_sum, dp, self.device)
        norm = self.stepper.step()
        self.steps += 1
        n = max(tokens, 1.0)
        m = self.mask(batch) > 0
        return {K.LEARNER_CRITIC_VALUE_LOSS: loss_total, K.LEARNER_CRITIC_VALUE_CLIPFRAC: clip_sum / n,
                K.LEARNER_CRITIC_VALUE_MEAN: float(old_values[m].mean()) if m.any() else 0.0,
                K.LEARNER_CRITIC_RETURN_MEAN: float(returns[m].mean()) if m.any() else 0.0,
                K.LEARNER_CRITIC_EXPLAINED_VAR: explained_variance(old_values, returns, self.mask(batch)),
                K.LEARNER_CRITIC_GRAD_NORM: norm}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """A plain-PyTorch critic's whole state: the trained parameters (trunk only when separate), the
        optimizer, steps. (A DeepSpeed critic's parameters and optimizer live in its engine: ``save``.)"""
        if self.engine is not None:
            raise ValueError("a DeepSpeed critic is checkpointed through its engine (Critic.save), not state_dict")
        state = {"mode": self.cfg.mode, "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "steps": self.steps}
        if self.cfg.mode == "separate":
            state["trunk"] = self.model.trunk.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != self.cfg.mode:
            raise ValueError(f"the checkpoint's critic has mode {state.get('mode')!r}, critic.mode={self.cfg.mode!r}")
        self.head.load_state_dict(state["head"])
        if self.cfg.mode == "separate":
            self.model.trunk.load_state_dict(state["trunk"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def save(self, directory: str | Path, rank: int = 0) -> Path:
        """Into a checkpoint directory. DeepSpeed: every rank calls this (the engine's save is collective:
        each rank writes its ZeRO partition into ``CRITIC_DIR``) and rank 0 writes the manifest
        (``CRITIC_FILE``); plain PyTorch: the whole state in ``CRITIC_FILE``."""
        path = Path(directory) / CRITIC_FILE
        if self.engine is None:
            torch.save(self.state_dict(), path)
            return path
        self.engine.save_checkpoint(str(Path(directory) / CRITIC_DIR), tag="engine")
        if rank == 0:
            torch.save({"mode": self.cfg.mode, "steps": self.steps, "format": "deepspeed"}, path)
        return path

    def load(self, directory: str | Path) -> None:
        path = Path(directory) / CRITIC_FILE
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {str(directory)!r} holds no critic ({CRITIC_FILE} is missing) "
                                    "but this run trains one (a stage has algo.name='ppo')")
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved = "deepspeed" if state.get("format") == "deepspeed" else "torch"
        if saved != ("torch" if self.engine is None else "deepspeed"):
            raise ValueError(f"checkpoint {str(directory)!r} holds a {saved} critic ({CRITIC_FILE}); this critic "
                             f"runs {'plain PyTorch' if self.engine is None else 'under DeepSpeed'}")
        if self.engine is None:
            self.load_state_dict(state)
            return
        if state.get("mode") != self.cfg.mode:
            raise ValueError(f"the checkpoint's critic has mode {state.get('mode')!r}, critic.mode={self.cfg.mode!r}")
        ds_dir = Path(directory) / CRITIC_DIR
        try:
            loaded, _ = self.engine.load_checkpoint(str(ds_dir), tag="engine", load_optimizer_states=True,
                                                    load_lr_scheduler_states=False)
        except Exception as e:
            raise ValueError(f"critic checkpoint {str(ds_dir)!r} could not be loaded: {e}") from e
        if loaded is None:
            raise ValueError(f"critic checkpoint {str(ds_dir)!r} holds no DeepSpeed engine state")
        self.steps = int(state["steps"])


def trains_terminal_value(cfg: CriticConfig) -> bool:
    """Whether the critic also trains V of the state after each response's last token toward 0, as RAG-R1's
    veRL fork does (``terminal_rows``): ``critic.terminal_value``, or where it is None exactly when
    ``critic.tokens='response'`` (the fork's masks)."""
    return cfg.tokens == "response" if cfg.terminal_value is None else bool(cfg.terminal_value)


def terminal_rows(batch: Batch) -> Tensor:
    """[B] bool: the rows whose terminal state RAG-R1's veRL fork trains. Its critic reads the values of the
    response grid shifted by one, ``values[:, -R-1:-1]`` masked by ``attention_mask[:, -R-1:-1]`` in
    ``compute_values`` and in the value loss (``dp_critic.py:93,100,136,178``, Search-R1's fork the same),
    while GAE and whitening use ``attention_mask[:, -R:]`` (``ray_trainer.py:131``). R is the batch's
    longest response (``generation.py`` pads the responses to it), so every row with a shorter response
    keeps one more value: the state after its last token, whose GAE return is exactly 0 (no reward, no
    later value) and which bootstraps its last token with weight gamma * (1 - lam) (none at RAG-R1's
    gamma = lam = 1). The longest responses have no such slot."""
    n = (batch.response_mask if batch.response_mask is not None else batch.loss_mask).gt(0).sum(dim=1)
    return (n < n.max()) & (batch.lengths >= 1) if n.numel() else torch.zeros(0, dtype=torch.bool)


def _pad_column(x: Tensor) -> Tensor:
    return torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)


def _with_terminal_states(values: Tensor | None, old: Tensor, returns: Tensor, mask: Tensor,
                          terminal_old: Tensor | None, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The value loss's grid, [b, t]: ``values`` (every state, [b, t]) beside V_old, the returns and the mask
    ([b, t-1], padded by one column), with each row's terminal state (column length - 1) added where
    ``terminal_old`` is finite: V_old there, return 0, mask 1."""
    old, returns, mask = _pad_column(old), _pad_column(returns), _pad_column(mask.to(old.dtype))
    if terminal_old is not None:
        rows = torch.nonzero(terminal_old.isfinite()).flatten()
        cols = lengths.to(rows.device)[rows] - 1
        old[rows, cols] = terminal_old[rows].to(old.dtype)
        returns[rows, cols] = 0.0
        mask[rows, cols] = 1.0
    return values, old, returns, mask


def gae_advantages(critic: Critic, batch: Batch, kl: Tensor | None, kl_coef: float,
                   dp: tuple[int, int] = (0, 1)) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's advantages for ``batch`` from the critic: V_old (no grad), the outcome on the last trained
    token minus ``kl_coef * kl`` per trained token, GAE with ``critic.gamma`` / ``critic.lam``, then
    whitening over the batch (``critic.whiten``). Returns (advantages float32, V_old, returns), all
    [B, T-1] on CPU, 0 where loss_mask is 0. ``dp``: V_old split across the data-parallel ranks (``predict``).

    With ``trains_terminal_value`` the states after the last token of ``terminal_rows`` join the recursion
    (return 0) and the value loss: their V_old is set on ``batch.old_terminal_values`` (NaN elsewhere), which
    ``Critic.update`` reads; otherwise that field is set to None."""
    old_values, terminal = critic.predict_all(batch, dp)
    mask = critic.mask(batch)  # critic.tokens: the model's tokens, or the whole response (RAG-R1's fork)
    # kl is 0 off the model's tokens (train_step multiplies it by loss_mask), as the fork's info_mask makes it
    rewards = outcome_token_rewards(batch.rewards, mask, kl, kl_coef if kl is not None else 0.0)
    rows = terminal_rows(batch) if trains_terminal_value(critic.cfg) else None
    if rows is not None and bool(rows.any()):
        batch.old_terminal_values = torch.where(rows, terminal, torch.full_like(terminal, float("nan")))
        _, v_all, _, m_all = _with_terminal_states(None, old_values, torch.zeros_like(old_values), mask,
                                                   batch.old_terminal_values, batch.lengths)
        adv, returns = gae(_pad_column(rewards), v_all, m_all, critic.cfg.gamma, critic.cfg.lam)
        adv, returns = adv[:, :-1], returns[:, :-1] * (mask > 0)
    else:
        batch.old_terminal_values = None
        adv, returns = gae(rewards, old_values, mask, critic.cfg.gamma, critic.cfg.lam)
    if critic.cfg.whiten:
        adv = masked_whiten(adv, mask)
    # the policy loss reads only the model's tokens (retrieved tokens are never trained)
    return torch.where(batch.loss_mask > 0, adv, torch.zeros_like(adv)).float(), old_values, returns.float()
