"""Advantage estimators as the config and the learner see them: one ``AlgoSpec`` per algorithm.

An algorithm is an estimator function registered in ``learner/algo/advantages.py`` (``ALGOS``; a user's
plug-in by ``stages.N.algo.name=path/to/file.py:fn``, ``cluster/wire/plugins.py``) that carries its spec
(``@algorithm(AlgoSpec(...))``). The config reads the spec for its defaults and checks (it imports nothing
of the learner); the learner reads it for what to run around the estimator (a critic). The built-ins'
specs are here, since the config needs them without importing torch; ``tests/cluster/test_plugins.py``
keeps every built-in estimator's spec equal to its entry.

The estimator's signature::

    fn(rewards [B], group_index [B] long, mask [B, T-1] float, *, std_normalize: bool,
       kl: [B, T-1] | None, kl_coef: float) -> advantages [B, T-1], 0 where mask is 0

Pure module: standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from sonar.cluster.wire import plugins as _plugins


@dataclass(frozen=True)
class AlgoSpec:
    """What an estimator needs and defaults to."""
    groups: bool
    """Its baseline is the group's: an RL stage needs ``rollout.group_size >= 2``."""
    critic: bool = False
    """A value model replaces its advantages by GAE (``critic.*``; the learner builds one, the memory plan
    counts it): PPO."""
    std_normalize: bool = False
    """``algo.std_normalize``'s default: divide the group-centred rewards by the group std."""
    no_std: str = ""
    """Why ``algo.std_normalize=True`` is refused for it (empty: allowed)."""
    dynamic_sampling: bool = False
    """``algo.dynamic_sampling``'s default: drop groups whose rewards are all equal (zero advantage)."""
    loss_agg: str = "token_mean"
    """``algo.loss_agg``'s default."""


_WHITENS = ("REINFORCE++ whitens over the batch (group_norm divides by the group std itself); leave it unset")
BUILTIN_SPECS: dict[str, AlgoSpec] = {
    "grpo": AlgoSpec(groups=True, std_normalize=True, dynamic_sampling=True),
    "dr_grpo": AlgoSpec(groups=True, no_std="Dr.GRPO has no std normalisation", dynamic_sampling=True,
                        loss_agg="seq_sum_norm"),
    "reinforce_pp": AlgoSpec(groups=False, no_std=_WHITENS),
    "reinforce_pp_baseline": AlgoSpec(groups=True, no_std=_WHITENS),
    "group_norm": AlgoSpec(groups=True, no_std=_WHITENS),
    "ppo": AlgoSpec(groups=False, critic=True, std_normalize=True),
}
"""The built-in algorithms' specs, by ``algo.name`` (in ``plugins.BUILTIN_NAMES["algorithm"]``'s order)."""


def algorithm(spec: AlgoSpec) -> Callable[[Callable], Callable]:
    """Decorator: the estimator carries its spec (``fn.spec``), a built-in's and a plug-in's alike."""
    if not isinstance(spec, AlgoSpec):
        raise TypeError(f"algorithm(spec): an AlgoSpec, not {type(spec).__name__}")

    def deco(fn: Callable) -> Callable:
        fn.spec = spec
        return fn
    return deco


def spec_of(name: str, field: str = "algo.name", sources: Mapping[str, str] | None = None) -> AlgoSpec:
    """The spec of the algorithm ``name``: a built-in's, or the one its plug-in carries. Raises ``ValueError``
    naming the field and the value for an unknown name or a plug-in without a spec."""
    if not _plugins.is_plugin(name):
        try:
            return BUILTIN_SPECS[name]
        except KeyError:
            raise ValueError(f"{field}={name!r} is not one of {list(BUILTIN_SPECS)} nor a plug-in "
                             "'module:attr' / 'file.py:attr'") from None
    fn: Any = _plugins.load(name, field, sources)
    spec = getattr(fn, "spec", None)
    if not isinstance(spec, AlgoSpec):
        raise _plugins.PluginError(f"{field}={name!r}: an algorithm plug-in carries its AlgoSpec: decorate it with "
                                   "@algorithm(AlgoSpec(groups=...)) from sonar.cluster.wire.algos")
    return spec


def trains_critic(cfg: Any) -> bool:
    """Whether an RL stage of ``cfg`` (a ``Config``) takes its advantages from a value model (``AlgoSpec.critic``:
    ppo), so the learner trains a critic."""
    return any(st.kind == "rl" and spec_of(st.algo.name, f"stages[{i}].algo.name", cfg.plugins).critic
               for i, st in enumerate(cfg.stages))
