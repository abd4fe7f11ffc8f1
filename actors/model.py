"""The policy: a tiny random Llama for the synthetic world, or a local Hugging Face directory.

Why this size: on 2 CPU cores a 2-layer, hidden-128 Llama with tied embeddings (~0.45M parameters
with the ~200-token world vocabulary) learns the search format and reaches ~85-90 % held-out EM within
minutes of SFT; a 4.3M-parameter model learned nothing in the same time (a measurement of an earlier session on this project's 2-core machine; not re-run here).

Invariants:
- ``build_policy`` is a pure function of (``ModelConfig``, tokenizer): every process that builds it
  gets bit-identical weights (the init runs under a forked, seeded torch RNG, so the caller's RNG
  state is untouched).
- ``vocab_size == len(tokenizer)``; pad/bos/eos ids in the model and generation configs are the
  tokenizer's, so ``generate`` stops on ``<eos>`` and pads with ``<pad>``.
- Attention is "sdpa" (``cluster.wire.policy.ATTN_IMPLEMENTATION``: measured there).
- Every role loads the policy from one Hugging Face directory with ``cluster.wire.policy.load_policy``;
  ``materialise_policy`` names ``model.path`` as it is when the tags stay plain text
  (``model.tags='text'``, the default there) or its tokenizer already has them; with
  ``model.tags='special'`` it writes ``model.path`` with the tags added as special tokens into the
  run's directory (``add_tags_to_policy``; see ``actors.tokenizer`` and ``actors.prompts``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# load_policy/save_policy live in the wire (the learner loads and exports with them); actors code and
# `sonar eval` keep importing them from here.
from sonar.cluster.wire.config import HUB_ID, model_tags
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
    """``model.tags='special'`` for a stock tokenizer: add every protocol tag it lacks as a special token
    (in place, ``actors.tokenizer.add_tags``) and give every added id the mean of the trained rows.
    Returns the tags added (none: model and tokenizer unchanged).

    Rows (notation: N = ``len(tokenizer)`` before, N' after the tags, R the embedding's rows): the
    trained rows are the first min(N, R) (no id >= N was ever produced by the tokenizer). The matrix
    grows to N' when R < N' and never shrinks: a padded vocabulary keeps its R rows (Qwen2.5-7B: R =
    152,064 for N = 151,665; ``resize_token_embeddings(N')`` would *shrink* it to 151,678), so the
    added ids N..N'-1 land on padding rows, which were never trained, and are overwritten here. Each
    added id's row is set to the float32 mean of the trained rows, cast to the weight's dtype, in the
    input embedding and, when untied, in the output head (and its bias, if any): a tag then starts
    as an average token instead of a random or never-trained one. A grown matrix is not padded to a
    multiple of 64: every extra row would be one more untrained id the policy can sample, and vLLM
    pads the vocabulary for its own kernels anyway.
    """
    from sonar.actors.tokenizer import add_tags

    n_before = len(tokenizer)
    added = add_tags(tokenizer)
    if not added:
        return added
    rows = model.get_input_embeddings().weight.shape[0]
    trained = min(n_before, rows)
    if len(tokenizer) > rows:
        # The new rows are overwritten below: no covariance-sampled init (``mean_resizing``) needed.
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    ids = torch.tensor([int(i) for i in tokenizer.convert_tokens_to_ids(added)], dtype=torch.long)
    inp = model.get_input_embeddings()
    out = model.get_output_embeddings()
    tensors = [inp.weight]
    if out is not None and out.weight is not inp.weight:  # an untied lm_head
        tensors.append(out.weight)
        if getattr(out, "bias", None) is not None:
            tensors.append(out.bias)
    with torch.no_grad():
        for w in tensors:
            w[ids] = w[:trained].mean(0, dtype=torch.float32).to(w.dtype)
    return added


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
    if path.exists() or not HUB_ID.match(value):
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


def materialise_policy(cfg, world, out_dir: str | Path, extra_vocab: Sequence[str] = (),
                       extra_tags: Sequence[str] = ()) -> str:
    """The directory every role loads the run's initial policy from (``cluster.wire.policy.load_policy``).

    ``cfg.path`` set: with the tags as plain text (``model_tags(cfg) == 'text'``, the default) the
    model is used as it is, so that directory is named (resolved, not copied; ``out_dir`` is not
    written); likewise when its tokenizer already has every protocol tag as one token. Otherwise
    (``'special'``) the model and tokenizer are loaded, the tags added as special tokens with their
    rows initialised (``add_tags_to_policy``), and the result is written into ``out_dir``: the user's
    directory is never modified, and every role (vLLM included) loads the same policy. Unset: the world's word tokenizer and a random tiny Llama
    (``build_policy``) saved into ``out_dir``; a pure function of (``cfg``, world), so a resumed run
    writes the same initial weights again. ``extra_vocab``: words the tiny model's tokenizer needs
    beyond the world's (the driver's ``cluster/driver/data.py:extra_vocab``, for runs on dataset files);
    ``extra_tags``: the run's tool tags (``actors.tools.tool_tags``), special tokens of the tiny model's
    tokenizer (a stock tokenizer keeps them as text, ``model.tags=text``).
    """
    if cfg.path:
        from sonar.actors.tokenizer import missing_tags
        from sonar.cluster.wire.policy import load_tokenizer

        path = resolve_model_path(cfg.path)
        if model_tags(cfg) == "text" or not missing_tags(load_tokenizer(path)):
            return str(path)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # The checkpoint's own dtype (a bf16 model stays bf16 on disk); every role casts on load.
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype="auto")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        add_tags_to_policy(model, tokenizer)
        return str(save_policy(model, tokenizer, out_dir))
    from sonar.actors.tokenizer import build_tokenizer

    tokenizer = build_tokenizer([*world.vocab(), *extra_vocab], extra_tags=extra_tags)
    return str(save_policy(build_policy(cfg, tokenizer), tokenizer, out_dir))


def policy_and_tokenizer(cfg, world):
    """``cfg.path`` set: load that directory (as it is with the tags as text; with
    ``model.tags='special'`` the tags it lacks are added in memory); else the world's word tokenizer +
    a random tiny Llama."""
    if cfg.path:
        model, tokenizer = load_policy(str(resolve_model_path(cfg.path)))
        if model_tags(cfg) == "special":
            add_tags_to_policy(model, tokenizer)
        return model, tokenizer
    from sonar.actors.tokenizer import build_tokenizer
    tokenizer = build_tokenizer(world.vocab())
    return build_policy(cfg, tokenizer), tokenizer
