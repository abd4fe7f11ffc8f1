"""The policy: a tiny random Llama for the synthetic world, or a local Hugging Face directory.

Why this size: on 2 CPU cores a 2-layer, hidden-128 Llama with tied embeddings (~0.45M parameters
with the ~200-token world vocabulary) learns the search format and reaches ~85-90 % held-out EM within
minutes of SFT; a 4.3M-parameter model learned nothing in the same time (see shared/GUIDE.md).

Invariants:
- ``build_policy`` is a pure function of (``ModelConfig``, tokenizer): every process that builds it
  gets bit-identical weights (the init runs under a forked, seeded torch RNG, so the caller's RNG
  state is untouched).
- ``vocab_size == len(tokenizer)``; pad/bos/eos ids in the model and generation configs are the
  tokenizer's, so ``generate`` stops on ``<eos>`` and pads with ``<pad>``.
- Attention is "sdpa" (``cluster.wire.policy.ATTN_IMPLEMENTATION``: measured there).
- Every role loads the policy from one Hugging Face directory with ``cluster.wire.policy.load_policy``;
  ``materialise_policy`` writes that directory for a run (or names ``model.path`` as it is when its
  tokenizer already has the tags; otherwise it writes ``model.path`` with the tags added, see
  ``actors.tokenizer`` for why tags are special tokens).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# load_policy/save_policy live in the wire (the learner loads and exports with them); actors code and
# `sonar eval` keep importing them from here.
from sonar.cluster.wire.policy import ATTN_IMPLEMENTATION, load_policy, save_policy  # noqa: F401


def build_policy(cfg, tokenizer) -> LlamaForCausalLM:
    """Random-init Llama from a ``ModelConfig`` (hidden/layers/heads/intermediate/positions/seed)."""
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"model.hidden_size={cfg.hidden_size} is not divisible by model.num_heads={cfg.num_heads}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.float().eval()


def add_tags_to_policy(model, tokenizer) -> list[str]:
    """Add every protocol tag the tokenizer lacks as a special token and resize the model's embeddings
    (new rows at the mean of the old ones, ``mean_resizing``). Returns the tags added (none: unchanged)."""
    from sonar.actors.tokenizer import add_tags

    added = add_tags(tokenizer)
    if added:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    return added


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _offline(env) -> bool:
    return str(env.get("HF_HUB_OFFLINE", "")).strip().lower() in ("1", "true", "yes", "on")


def resolve_model_path(value: str, *, env=None, download=None) -> Path:
    """``model.path`` -> a local Hugging Face model directory.

    A local folder with ``config.json`` is used as it is. A value that is not a local path and looks like
    a Hub id (``org/name``) is fetched with ``huggingface_hub.snapshot_download`` (``download``: injected
    in tests): from the local cache only when ``HF_HUB_OFFLINE`` is set (the ``sonar`` CLI sets it unless
    the environment says otherwise), and an id not in the cache then raises ``ValueError`` naming the
    field and the id. Anything else raises ``ValueError`` naming the field."""
    env = os.environ if env is None else env
    path = Path(os.path.expanduser(value))
    if (path / "config.json").is_file():
        return path
    if path.exists() or not _HUB_ID.match(value):
        raise ValueError(f"model.path={value!r} is not a Hugging Face model directory (no config.json)")
    if download is None:
        from huggingface_hub import snapshot_download as download
    offline = _offline(env)
    try:
        local = download(repo_id=value, local_files_only=offline)
    except Exception as e:  # noqa: BLE001 - not cached / not found / no network: name the field and the id
        if offline:
            raise ValueError(f"model.path={value!r} is a Hugging Face Hub id, but HF_HUB_OFFLINE=1 and it is not in "
                             f"the local cache: set HF_HUB_OFFLINE=0 where a hub is reachable, or point model.path "
                             f"at a local model directory") from None
        raise ValueError(f"model.path={value!r}: cannot download it from the Hugging Face Hub "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    if not (Path(local) / "config.json").is_file():
        raise ValueError(f"model.path={value!r}: the Hub snapshot {local} has no config.json")
    return Path(local)


def materialise_policy(cfg, world, out_dir: str | Path, extra_vocab: Sequence[str] = ()) -> str:
    """The directory every role loads the run's initial policy from (``cluster.wire.policy.load_policy``).

    ``cfg.path`` set: when its tokenizer already has every protocol tag as one token, that directory
    is used as it is (checked, not copied). Otherwise the model and tokenizer are loaded, the tags
    added as special tokens and the embeddings resized (``add_tags_to_policy``), and the result is
    written into ``out_dir``: the user's directory is never modified, and every role (vLLM included)
    loads the same resized policy. Unset: the world's word tokenizer and a random tiny Llama
    (``build_policy``) saved into ``out_dir``; a pure function of (``cfg``, world), so a resumed run
    writes the same initial weights again. ``extra_vocab``: words the tiny model's tokenizer needs
    beyond the world's (the driver's ``cluster/driver/data.py:extra_vocab``, for runs on dataset files).
    """
    if cfg.path:
        from sonar.actors.tokenizer import missing_tags
        from sonar.cluster.wire.policy import load_tokenizer

        path = resolve_model_path(cfg.path)
        if not missing_tags(load_tokenizer(path)):
            return str(path)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # The checkpoint's own dtype (a bf16 model stays bf16 on disk); every role casts on load.
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype="auto")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        add_tags_to_policy(model, tokenizer)
        return str(save_policy(model, tokenizer, out_dir))
    from sonar.actors.tokenizer import build_tokenizer

    tokenizer = build_tokenizer([*world.vocab(), *extra_vocab])
    return str(save_policy(build_policy(cfg, tokenizer), tokenizer, out_dir))


def policy_and_tokenizer(cfg, world):
    """``cfg.path`` set: load that directory (tags added in memory if it lacks them); else the world's
    word tokenizer + a random tiny Llama."""
    if cfg.path:
        model, tokenizer = load_policy(str(resolve_model_path(cfg.path)))
        add_tags_to_policy(model, tokenizer)
        return model, tokenizer
    from sonar.actors.tokenizer import build_tokenizer
    tokenizer = build_tokenizer(world.vocab())
    return build_policy(cfg, tokenizer), tokenizer
