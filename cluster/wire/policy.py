"""The policy on disk: one Hugging Face directory (weights + config + tokenizer) that every role loads.

The driver materialises the run's initial policy once (``<run>/policy``, built by
``sonar.actors.model`` from the world's tokenizer, or ``model.path`` used as it is); the learner, the
rollout workers, ``sonar eval`` and vLLM then load that directory with plain transformers. So no role
needs to know how the policy was built, and every role holds the same parameter names and shapes (the
broadcast layout digests agree).

Invariants:
- ``save_policy`` writes a self-contained directory that ``load_policy`` (or ``AutoModelForCausalLM`` /
  ``AutoTokenizer``) reloads offline, bit for bit (fp32 safetensors).
- ``pad_id`` comes from the tokenizer, else the model config, else EOS: never from the world.

Imports only torch and transformers (no other part of Sonar).
"""
from __future__ import annotations

from pathlib import Path

ATTN_IMPLEMENTATION = "sdpa"
"""Measured here (1 thread, default world, 0.51M parameters): forward+backward of a 64 x 100 batch
took 280-284 ms with sdpa vs 291-295 ms with eager; greedy cached decoding of 64 rows took 2.8-3.0 ms
per token with either. sdpa is never slower, so it is the default."""


def _require_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ValueError(f"policy directory {str(path)!r} is not a Hugging Face model directory (no config.json); "
                         "model.path must name one")
    return path


def load_policy(path: str | Path, *, weights: bool = True):
    """``(model, tokenizer)`` from a local HF directory, fp32, in eval mode; never touches the network.

    ``weights=False`` builds the model from its config on the meta device: parameter names, shapes and
    dtypes only, no memory and no read of the weights (a vLLM rollout worker needs just the layout;
    vLLM loads the weights itself, and a 3B policy would otherwise cost 12 GB of RAM per worker)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = _require_dir(Path(path).expanduser())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not weights:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                     attn_implementation=ATTN_IMPLEMENTATION)
        return model.eval(), tokenizer
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                 attn_implementation=ATTN_IMPLEMENTATION)
    return model.eval(), tokenizer


def load_tokenizer(path: str | Path):
    """The tokenizer of a policy directory alone (the driver needs it to build demonstrations)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_require_dir(Path(path).expanduser()), local_files_only=True)


def save_policy(model, tokenizer, path: str | Path) -> Path:
    """Weights (safetensors) + config + generation config + tokenizer into one directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def pad_id(model, tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad token, else the model config's, else EOS."""
    config = getattr(model, "config", None)
    for source, attr in ((tokenizer, "pad_token_id"), (config, "pad_token_id"),
                         (tokenizer, "eos_token_id"), (config, "eos_token_id")):
        v = getattr(source, attr, None)
        if isinstance(v, (list, tuple)):  # some configs list several EOS ids
            v = v[0] if v else None
        if v is not None:
            return int(v)
    raise ValueError("the policy has no pad_token_id and no eos_token_id in its tokenizer or config: "
                     "cannot pad batches")
