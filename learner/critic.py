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

The head starts at zero (weight and bias), so the first values are 0 and the first GAE advantages
are the plain returns; veRL initialises its score head randomly. The optimizer is plain PyTorch (the
learner is one rank): not a DeepSpeed engine, so ZeRO does not shard the critic. Its learning rate
is constant (veRL warms the critic's up over 1.5 % of training in RAG-R1's script).

Notation: B sequences, T tokens; values are [B, T-1], column t = V of the state "tokens <= t", the
state in which token t+1 is chosen (aligned with ``Batch.loss_mask``).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import CriticConfig, LearnerConfig
from sonar.learner.algo.gae import explained_variance, gae, masked_whiten, outcome_token_rewards, value_loss
from sonar.learner.batching import Batch, pack_micro_batches

CRITIC_FILE = "critic.pt"
"""The critic's state inside a checkpoint directory (trunk, head, optimizer, step count)."""


def _trunk_of(model: nn.Module) -> nn.Module:
    """The decoder stack of a Hugging Face causal LM (``model.model`` for Llama/Qwen), without its head."""
    prefix = getattr(model, "base_model_prefix", "")
    trunk = getattr(model, prefix, None) if prefix else None
    if trunk is None:
        raise ValueError(f"cannot find the trunk of {type(model).__name__} (base_model_prefix={prefix!r})")
    return trunk


class Critic:
    """``values`` / ``predict`` (no grad) and ``update`` (one optimizer step over a batch)."""

    def __init__(self, cfg: CriticConfig, lcfg: LearnerConfig, *, policy_dir: str | None = None,
                 policy_module: nn.Module | None = None, device: torch.device | str = "cpu"):
        self.cfg, self.lcfg, self.device = cfg, lcfg, torch.device(device)
        if cfg.mode == "separate":
            if policy_dir is None:
                raise ValueError("critic.mode='separate' needs the policy directory to initialise from")
            from sonar.cluster.wire.policy import load_policy

            model, _ = load_policy(policy_dir)
            self.trunk = _trunk_of(model).to(self.device)
            hidden = model.config.hidden_size
            del model  # the LM head is not kept
        elif cfg.mode == "head":
            if policy_module is None:
                raise ValueError("critic.mode='head' needs the policy module whose trunk it reads")
            self.trunk = _trunk_of(policy_module)
            hidden = policy_module.config.hidden_size
        else:
            raise ValueError(f"critic.mode={cfg.mode!r} is not separate|head")
        self.head = nn.Linear(hidden, 1).to(self.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        params = list(self.head.parameters())
        if cfg.mode == "separate":
            self.trunk.train()
            params = [p for p in self.trunk.parameters() if p.requires_grad] + params
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(lcfg.betas),
                                           weight_decay=lcfg.weight_decay)
        self.steps = 0

    # ------------------------------------------------------------------ forward
    def values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[b, t-1] float32 values of a (micro-)batch; differentiable in the critic's own parameters."""
        if self.cfg.mode == "head":
            with torch.no_grad():
                hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask,
                                    use_cache=False).last_hidden_state
            hidden = hidden.detach()
        else:
            hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden.float()).squeeze(-1)[:, :-1]

    def _micro_batches(self, batch: Batch) -> list[list[int]]:
        return pack_micro_batches(batch.lengths.tolist(), self.lcfg.micro_batch_tokens)

    @torch.no_grad()
    def predict(self, batch: Batch) -> Tensor:
        """V_old: [B, T-1] float32 (on CPU) for the whole batch, 0 where loss_mask is 0."""
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        for idx in self._micro_batches(batch):
            mb = batch.select(idx).to(self.device)
            v = self.values(mb.input_ids, mb.attention_mask).cpu()
            out[torch.as_tensor(idx)[:, None], torch.arange(v.shape[1])[None, :]] = v
        return torch.where(batch.loss_mask > 0, out, torch.zeros_like(out))

    # ------------------------------------------------------------------ update
    def update(self, batch: Batch, old_values: Tensor, returns: Tensor) -> dict[str, float]:
        """One optimizer step on the clipped value loss over ``batch`` (micro-batched; every micro-batch
        divides by the batch's token count, so the gradients sum to the full-batch one), gradient norm
        clipped at ``learner.grad_clip``. Returns the value loss, its clip fraction, the means of
        V_old and of the returns, explained_variance (of V_old) and grad_norm, keyed by
        ``K.LEARNER_CRITIC_*``. ``old_values`` and ``returns`` are [B, T-1] for the whole batch."""
        tokens = float((batch.loss_mask > 0).sum())
        loss_total, clip_sum = 0.0, 0.0
        self.optimizer.zero_grad(set_to_none=True)
        if self.cfg.mode == "separate":
            self.trunk.train()
        for idx in self._micro_batches(batch):
            mb = batch.select(idx).to(self.device)
            w = mb.loss_mask.shape[1]
            rows = torch.as_tensor(idx)
            old = old_values[rows, :w].to(self.device)
            ret = returns[rows, :w].to(self.device)
            v = self.values(mb.input_ids, mb.attention_mask)
            out = value_loss(v, old, ret, mb.loss_mask, self.cfg.value_clip, tokens=tokens)
            out.loss.backward()
            n = float((mb.loss_mask > 0).sum())
            loss_total += float(out.loss.detach())
            clip_sum += out.metrics["value_clipfrac"] * n
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.lcfg.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.lcfg.grad_clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        n = max(tokens, 1.0)
        m = batch.loss_mask > 0
        return {K.LEARNER_CRITIC_VALUE_LOSS: loss_total, K.LEARNER_CRITIC_VALUE_CLIPFRAC: clip_sum / n,
                K.LEARNER_CRITIC_VALUE_MEAN: float(old_values[m].mean()) if m.any() else 0.0,
                K.LEARNER_CRITIC_RETURN_MEAN: float(returns[m].mean()) if m.any() else 0.0,
                K.LEARNER_CRITIC_EXPLAINED_VAR: explained_variance(old_values, returns, batch.loss_mask),
                K.LEARNER_CRITIC_GRAD_NORM: norm}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Everything a resume needs: the trained parameters (trunk only when separate), the optimizer, steps."""
        state = {"mode": self.cfg.mode, "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "steps": self.steps}
        if self.cfg.mode == "separate":
            state["trunk"] = self.trunk.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != self.cfg.mode:
            raise ValueError(f"the checkpoint's critic has mode {state.get('mode')!r}, critic.mode={self.cfg.mode!r}")
        self.head.load_state_dict(state["head"])
        if self.cfg.mode == "separate":
            self.trunk.load_state_dict(state["trunk"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CRITIC_FILE
        torch.save(self.state_dict(), path)
        return path

    def load(self, directory: str | Path) -> None:
        path = Path(directory) / CRITIC_FILE
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {str(directory)!r} holds no critic ({CRITIC_FILE} is missing) "
                                    "but this run trains one (a stage has algo.name='ppo')")
        self.load_state_dict(torch.load(path, map_location=self.device, weights_only=False))


def gae_advantages(critic: Critic, batch: Batch, kl: Tensor | None, kl_coef: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's advantages for ``batch`` from the critic: V_old (no grad), the outcome on the last trained
    token minus ``kl_coef * kl`` per trained token, GAE with ``critic.gamma`` / ``critic.lam``, then
    whitening over the batch (``critic.whiten``). Returns (advantages float32, V_old, returns), all
    [B, T-1] on CPU, 0 where loss_mask is 0."""
    old_values = critic.predict(batch)
    rewards = outcome_token_rewards(batch.rewards, batch.loss_mask, kl, kl_coef if kl is not None else 0.0)
    adv, returns = gae(rewards, old_values, batch.loss_mask, critic.cfg.gamma, critic.cfg.lam)
    if critic.cfg.whiten:
        adv = masked_whiten(adv, batch.loss_mask)
    return adv.float(), old_values, returns.float()
