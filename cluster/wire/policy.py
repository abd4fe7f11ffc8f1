"""The policy on disk: one Hugging Face directory (weights + config + tokenizer) that every role loads.

The driver materialises the run's initial policy once (``<run>/policy``, built by
``sonar.actors.model`` from the world's tokenizer, or ``model.path`` used as it is); the learner, the
rollout workers, ``sonar eval`` and vLLM then load that directory with plain transformers. So no role
needs to know how the policy was built, and every role holds the same parameter names and shapes (the
broadcast layout digests agree).

Invariants:
- ``save_policy`` writes a self-contained directory that ``load_policy`` (or ``AutoModelForCausalLM`` /
  ``AutoTokenizer``) reloads offline, bit for bit (safetensors in the model's dtype: fp32, or bf16 from a
  bf16 learner, which ``load_policy`` widens to fp32 exactly).
- ``pad_id`` comes from the tokenizer, else the model config, else EOS: never from the world.
- With LoRA (``learner.lora``), the learner and the transformers engines wrap the loaded policy alike
  (``with_lora``: the same adapters, names and initial values), so the push layout is the adapters'.

Imports only torch, transformers and peft (no other part of Sonar).
"""
from __future__ import annotations

from pathlib import Path

ATTN_IMPLEMENTATION = "sdpa"
"""Measured here (1 thread, default world, 0.51M parameters): forward+backward of a 64 x 100 batch
took 280-284 ms with sdpa vs 291-295 ms with eager; greedy cached decoding of 64 rows took 2.8-3.0 ms
per token with either. sdpa is never slower, so it is the default."""


def _require_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        import socket

        # On a cluster the usual cause is storage only the driver's node has: say where we are.
        where = "" if path.exists() else (f" on node {socket.gethostname()}: the directory does not exist here "
                                          "(on a cluster, mount the storage holding model.path and run.root at "
                                          "the same path on every node)")
        raise ValueError(f"policy directory {str(path)!r} is not a Hugging Face model directory (no config.json)"
                         f"{where}; model.path must name one")
    return path


def load_policy(path: str | Path, *, weights: bool = True, dtype=None):
    """``(model, tokenizer)`` from a local HF directory, in ``dtype`` (a torch dtype; default fp32), in eval
    mode; never touches the network.

    ``weights=False`` builds the model from its config on the meta device: parameter names, shapes and
    dtypes only, no memory and no read of the weights (a vLLM rollout worker needs just the layout;
    vLLM loads the weights itself, and a 3B policy would otherwise cost 12 GB of RAM per worker), with the
    directory's generation config (the learner writes its exports through such a model).

    Inside ``learner.deepspeed_config.zero3_loading`` (transformers' ``HfDeepSpeedConfig`` alive) the model
    is built in ``deepspeed.zero.Init`` and the weights are loaded into its partitions: pass the ZeRO
    config's dtype as ``dtype``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dtype = torch.float32 if dtype is None else dtype
    path = _require_dir(Path(path).expanduser())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not weights:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        if (path / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
        return model.eval(), tokenizer
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                 attn_implementation=ATTN_IMPLEMENTATION)
    return model.eval(), tokenizer


def load_tokenizer(path: str | Path):
    """The tokenizer of a policy directory alone (the driver needs it to build demonstrations)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_require_dir(Path(path).expanduser()), local_files_only=True)


def save_policy(model, tokenizer, path: str | Path, state_dict: dict | None = None) -> Path:
    """Weights (safetensors) + config + generation config + tokenizer into one directory. ``state_dict``:
    the weights to write instead of ``model``'s own (then ``model`` may be a meta-device model of the
    config, in the dtype the config should record); transformers consumes the dict (it pops from it)."""
    from transformers.utils import logging as hf_logging

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # No "Writing model shards" bar: the driver writes the initial policy, the learner its exports, a
    # vLLM worker its engine's copy, and each bar is a line of the run's log (the actors' env turns bars
    # off already, ``sonar.cluster.wire.bootstrap.ACTOR_ENV``; the driver's, one per run, was left).
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path, state_dict=state_dict)
        tokenizer.save_pretrained(path)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return path


ADAPTER_DIR = "adapter"
"""In an export of a LoRA run (``<run>/model``, a checkpoint's ``hf``): the trained adapter as peft writes it
(``PeftModel.from_pretrained(base, ...)``, ``write_adapter``); the export itself is the merged model."""
REFERENCE_ADAPTER = "reference"
"""The learner's second, frozen adapter: the trained one's values at the start of a stage with a KL term,
so the KL reference is the policy at the stage's start, as with full fine-tuning, without a second copy of
the base (``AdapterReference``). Never pushed nor served."""


def with_lora(model, lora, seed: int, reference: bool = False):
    """``model`` (a loaded causal LM) wrapped by peft with trainable adapters per ``lora`` (a
    ``LoraConfig``): every other parameter frozen. The adapters' initial values come from ``seed`` alone
    (the global RNG is left as it was), so the learner and every engine start from the same ones; they are
    in the base's dtype (no fp32 upcast), as the engines hold them. ``reference``: add the frozen
    ``REFERENCE_ADAPTER`` beside the trained one (the learner, when a stage has a KL term)."""
    import torch
    from peft import get_peft_model

    pc = _peft_config(vars(lora))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(model, pc, autocast_adapter_dtype=False)
        if reference:
            model.add_adapter(REFERENCE_ADAPTER, pc)
    for name, p in model.named_parameters():
        if f".{REFERENCE_ADAPTER}." in name:
            p.requires_grad_(False)  # peft leaves only the active adapter trainable; say so for the frozen one
    return model


def _peft_config(lora: dict, base: str | None = None):
    """peft's ``LoraConfig`` of ``learner.lora``'s fields (a dict): what ``with_lora`` wraps with and what
    ``write_adapter`` writes beside the tensors, so the engines load the adapter the learner trained."""
    from peft import LoraConfig

    return LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), lora_dropout=float(lora["dropout"]),
                      target_modules=list(lora["target_modules"]), task_type="CAUSAL_LM",
                      base_model_name_or_path=None if base is None else str(base))


def base_model(module):
    """The Hugging Face model under a peft wrapper (or ``AdapterReference``), else ``module`` itself: where
    the output head, the trunk and ``forward``'s own arguments are."""
    get = getattr(module, "get_base_model", None)
    return get() if callable(get) else module


def write_adapter(tensors, lora: dict, path: str | Path, base: str | None = None) -> Path:
    """The trained adapter written as peft writes one, ``adapter_config.json`` and ``adapter_model.safetensors``
    (names without the adapter's name), which ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load.
    ``tensors``: ``(name, tensor)`` pairs of a peft policy's ``.default.`` adapter (as the learner pushes them;
    others are skipped); ``lora``: ``LoraConfig``'s fields as a dict. Atomic: written beside ``path`` and
    renamed over it, so a reader sees the old adapter or the new one."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    out = {n.replace(".default.", "."): t.detach().to("cpu").contiguous()
           for n, t in tensors if ".lora_" in n and ".default." in n}
    if not out:
        raise ValueError("no trained adapter tensors (lora_A/lora_B .default.) to write")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    _peft_config(lora, base).save_pretrained(str(tmp))
    save_file(out, str(tmp / "adapter_model.safetensors"))
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
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
