"""The GPU memory plan: what each learner GPU and each vLLM GPU will hold (colocated placement: each GPU a
learner rank shares with its engine, phase by phase), computed at config load.

``config.validate`` calls :func:`plan_for` last (``_check_memory``) and refuses a plan that does not fit
the declared GPU memory, naming the fields to change; ``sonar config validate|show`` and ``sonar train``
print it. Nothing is allocated: the parameter count comes from the model built on the meta device
(``with torch.device("meta"): AutoModelForCausalLM.from_config(...)``, no weights), the rest is
arithmetic on ``config.json``'s shape and the run's config. All sizes are bytes (shown as GiB, 2**30
bytes, one decimal). Notation: N parameters (a tied embedding counted once), R = ``learner.num_ranks``,
z = ``learner.zero_stage``, p = bytes per element of the training dtype (2 for bf16, 4 for fp32),
T tokens of a micro-batch, H hidden, I intermediate, L layers, V vocabulary, q = heads x head_dim,
kv = kv_heads x head_dim.

**Learner GPU** (rank 0, the largest: it alone holds the push buffers). Model states, per DeepSpeed
ZeRO (``deepspeed/runtime/zero/stage_1_and_2.py``, ``stage3.py``; Sonar's torch AdamW keeps fp32 m and v
on the fp32 master copy, and DeepSpeed keeps that master copy whenever the model is bf16, ZeRO-0
included, ``fp16/unfused_optimizer.py``):

    parameters        p x N / (R if z = 3 else 1)
    gradients         p x N / (R if z >= 2 else 1)      (0 on the GPU with z >= 2 and optimizer offload:
                                                         reduced straight into the CPU partition)
    fp32 master       4 x N / (R if z >= 1 else 1)      (bf16 only; CPU with ``learner.offload_optimizer``)
    Adam m + v        8 x N / (R if z >= 1 else 1)      (CPU with ``learner.offload_optimizer``)
    step fp32 grads   4 x N / (R if z >= 1 else 1)      (bf16 only, during ``optimizer.step`` only: the
                                                         bf16 gradient partition converted to fp32,
                                                         ``stage_1_and_2.py`` ``single_grad_partition``;
                                                         CPU with offload)
    ZeRO-3 gathered   4 x largest layer's parameters    (z = 3: the gathered bf16 parameters and
                                                         gradients of the largest module, DeepSpeed's
                                                         own ``largest_layer_memory``)
    reduce bucket     5e8 elements x p                  (z >= 2: DeepSpeed's ``reduce_bucket_size``
                                                         default, one contiguous buffer; Sonar sets none)

Against DeepSpeed's own estimators (``tests/cluster/test_memory_plan.py`` calls them):
``stage_1_and_2.estimate_zero2_model_states_mem_needs`` gives 2N + 18N/R on the GPU (16-bit parameters,
16-bit and 32-bit gradient partitions, 32-bit master, Adam) and 2N with offload, which is exactly the
sum of the first five rows at z = 2; ``stage3.estimate_zero3_model_states_mem_needs`` gives
4 x largest layer + 18N/R (2N/R with offload), which is this plan less the bf16 gradient partition
(2N/R, ``stage3.py``'s ``grad_partitions_flat_buffer``, which the estimator leaves out).

Beside the policy: the **KL reference** (only when an RL stage has ``algo.kl_coef > 0``) in the training
dtype, p x N / (R if z = 3 else 1) (sharded with the policy under ZeRO-3); the **PPO critic** (when an RL
stage runs ``algo.name=ppo`` with ``critic.mode=separate``): the trunk without the LM head plus a scalar
head (N_c = trunk + H + 1 parameters) under DeepSpeed with the same ZeRO stage, so the same five rows
over N_c; the **push send buffers** on rank 0 with an NCCL broadcast: ``weights.send_buffer_bytes`` of the
push's own bucket plan (``weights.plan_buckets`` over the model's parameters in the training dtype,
``DEFAULT_BUCKET_BYTES``): two stream buffers, each as large as the largest bucket that goes through it
and needs flattening, so at most a bucket's bytes: a bucket of one tensor (a 7B's embedding, its MLP
matrices) is sent from the tensor itself (gloo from a GPU learner flattens into host memory: nothing on
the GPU); and a **CUDA context + NCCL**
constant of 1.0 GiB: a CUDA 12/13 context with
torch's kernels loaded lazily (``CUDA_MODULE_LOADING=LAZY``, the default) is commonly 0.3-0.6 GiB on an
H100 (the usual figure of ``torch.cuda.mem_get_info`` before and after the first CUDA call; not
measured in this project yet: no GPU was lent to the session that wrote this), and each NCCL
communicator allocates its channel buffers on the device (``NCCL_BUFFSIZE`` 4 MiB per channel and
peer: tens to a few hundred MiB for the two groups a learner rank joins), so 1.0 GiB covers both with
some room for allocator slack.

**LoRA** (``learner.lora.rank`` = r > 0: ``cluster/wire/policy.py`` ``with_lora``, ``learner/README.md``
"LoRA"): the base is frozen, p x N / (R if z = 3 else 1) with no gradient nor optimizer state (DeepSpeed
flattens and partitions the optimizer's parameters alone, and the learner gives it the trainable ones), and
the five rows above count the adapter's A parameters instead of N: A = the sum of r x (in + out) over the
``nn.Linear`` modules whose last name component is in ``learner.lora.target_modules`` (A [r, in] and
B [out, r] in the base's dtype), read off the meta model (``ModelShape.linears``; a 7B at r = 16: 40.4e6,
80.7 MB in bf16). Under ZeRO-3 the gathered layer is p x its parameters (the embedding, frozen: no
gradient); the reduce bucket is allocated whole whatever the trainable count. The KL reference is a
second, frozen adapter, p x A / (R if z = 3 else 1), not a second model (``learner/lora.py``); a push
moves the trained adapter alone, so the send and receive buffers come from the bucket plan of its tensors
(:func:`adapter_tensors`); a vLLM GPU is otherwise planned as without LoRA (its LoRA slot, inside the
reservation, is not counted). The PPO critic is a full model either way. Activations are the full model's
(the frozen base still carries the gradient back to the adapters). Not counted: with
``learner.lora.dropout > 0``, peft's dropped copy of each targeted module's input (p x in per token and
module; one layer's with checkpointing), and the adapters under DeepSpeed's
``stage3_param_persistence_threshold`` (1e5 elements) that ZeRO-3 keeps whole on every rank (< p x A).

**Activations** of one micro-batch of T = max(``learner.micro_batch_tokens``, ``protocol.max_total_tokens``)
tokens (a longer sequence is a micro-batch of its own, ``learner/batching.py``), for a pre-norm decoder
(Llama/Qwen2: RMSNorm, grouped-query attention with flash/SDPA, SwiGLU). Saved for the backward pass,
per token and layer:

    saved = 8H + p x (2H + 3q + 2kv + 4I) + 4 x heads
            (two RMSNorms: their fp32 input 4H each and output pH each; rotated q and k, v, the
             attention output and its reshaped copy; the MLP's gate, up, SiLU(gate), product; the
             attention's fp32 log-sum-exp per head)
    grads in flight during one layer's backward: p x (3I + 2H)

With ``learner.gradient_checkpointing``: L layer inputs [T, H] kept, one layer recomputed:
T x (L x pH + (4 + p)H + saved + in-flight); without: T x (L x saved + in-flight + (4 + p)H). Plus the
**logits**: min(C, T) x V x 4 bytes x 3 (the fp32 logits, their softmax, their gradient), C =
``learner.logits_chunk_tokens`` (0: C = T, unchunked). The activations and logits exist in the forward
and backward passes, the step fp32 gradients during the optimizer step (the critic's during its own),
never together: the learner's peak is the held rows plus the largest of these phases. A no-grad forward (KL reference, old
logprobs) holds one layer's transients at a time, less than the backward's working set, and the
critic's passes run apart from the policy's: neither adds a row.

**vLLM GPU** (each GPU of an engine; ``rollout.engine=vllm`` with ``rollout.num_gpus_per_worker > 0``):
vLLM takes ``rollout.vllm_gpu_memory_utilization`` x GPU memory (``vllm/v1/worker/utils.py``
``request_memory``: that much must be free at start) for its weights, activations and KV cache; with
``rollout.vllm_kv_cache_gib > 0`` it uses weights + activations + that KV instead. Weights: N x e / tp
(e: ``config.engine_dtype`` bytes, tp = ``rollout.tensor_parallel_size``). Activation peak of vLLM's
profile run (no autograd, ``max_num_batched_tokens`` tokens: the engine's step budget, which
``actors/engine_vllm.py`` passes as ``resolved.vllm_batched_tokens``: ``rollout.vllm_max_num_batched_tokens``,
else ``rollout.max_batch_rows + protocol.max_total_tokens`` on GPU) x e x (3I/tp + 3H + (q + 2kv)/tp) +
``rollout.max_batch_rows`` x V x 4 x 2 (the sampler's fp32 logits and probabilities). KV left = reservation - weights - activations;
tokens it holds: KV / (2 x L x kv_heads_per_gpu x head_dim x e) with kv_heads_per_gpu = max(1,
kv_heads / tp). Outside the reservation (NCCL broadcast): the streamed receive buffers,
``weights.recv_buffer_bytes``, two buffers each as large as the largest bucket through it (a 7B: its
1.0 GiB embedding and LM head in one, a 136 MB MLP matrix in the other), the copies vLLM's
layerwise reload keeps of a layer that straddles two buckets (at most one decoder layer x p), the
chunked checksum's float64 temporary ``weights.CHECKSUM_CHUNK_BYTES``, and the CUDA context + NCCL
constant. Refused when reservation + outside > GPU memory, when the weights and
activations leave no KV for one ``protocol.max_total_tokens`` trajectory, or when tp does not divide
the attention heads (vLLM refuses that itself, at start).

**Colocated GPU** (``cluster.placement=colocated``: each learner rank shares its GPU with one vLLM engine
of TP 1, sync mode; ``ClusterConfig.placement``, ``cluster/driver/colocate.py``). The two take turns, so
the plan is one GPU per rank with the peak of three phases of an RL step, never alive together:

    generation   vLLM reservation (as above) + the engine's receive buffers + its CUDA context
                 + what the learner keeps: every held row of the learner plan, or, with
                 ``learner.offload_while_generating``, its parameters (policy, critic), the KL reference,
                 the hand-over's buffers and its context (DeepSpeed's ``offload_states``,
                 ``stage_1_and_2.py`` / ``stage3.py``, moves the gradients, fp32 master and Adam to host
                 memory and ends with ``empty_cache``, which frees ZeRO's reduce bucket and gathered layer)
    training     the learner plan (its held rows and its largest transient phase) + the sleeping engine:
                 its CUDA context and receive buffers. vLLM's sleep (``vllm/v1/worker/gpu_worker.py``
                 ``Worker.sleep``, ``vllm/device_allocator/cumem.py`` ``CuMemAllocator.sleep``) releases what
                 its allocator pool holds: level 1 copies the weights to host memory and drops the KV cache,
                 level 2 drops both; tensors of torch's own allocator (the receive buffers) stay
    hand-over    the engine's weights (woken alone, ``wake_up(tags=["weights"])``; the KV cache after the
                 learner offloaded) N x e + its receive buffers + the layer reload's held copies + the
                 checksum chunk + its context, beside the learner's held rows (it offloads after the push)

The learner's push rows are the hand-over's (``cluster/transport/handover.py``, every rank: each hands over to
its own engine): two send stream buffers as the NCCL push has them (under ZeRO-3 every bucket is
flattened, the per-bucket gathers of ``learner/worker.py``) and the CUDA IPC segment, as large as the
largest bucket (a 7B: its 1.09 GB embedding); no NCCL buffers. vLLM refuses to start unless
``rollout.vllm_gpu_memory_utilization`` x GPU is free (``request_memory``, above, whatever
``rollout.vllm_kv_cache_gib``): beside a resident learner that is learner kept + engine context +
utilisation x GPU <= GPU, shown under the phases (the generation phase, which adds the receive buffers,
is never smaller with a utilisation-sized reservation). That check assumes the runtime starts the engines
beside a learner already in its generation state (its states offloaded first, with the flag): a learner
holding its whole training state at that moment needs its held rows there instead. Refused, naming each phase with its figures and
the single changes that fit (each re-planned): the utilisation, ``learner.offload_while_generating``,
``learner.zero_stage``, ``learner.offload_optimizer``, more ranks (``learner.num_ranks`` and
``rollout.num_workers`` together), the micro-batch; and when the reservation leaves KV for less than one
``protocol.max_total_tokens`` trajectory. Host memory (the engine's weights asleep at level 1, the
learner's offloaded states) is shown, not checked.

Not modelled: CUDA graphs' memory (vLLM counts it inside its reservation), allocator fragmentation
(partly in the 1.0 GiB constant), the CPU side (shown, not checked). The GPU memory each GPU has is
``cluster.gpu_memory_gib``, else ``$SONAR_GPU_MEMORY_GIB`` (the cluster files set it from their GPU node
type), else 80 (assumed, and the plan says so).

Pure: torch, transformers and the standard library; of Sonar only ``sonar.cluster.wire``. Run as
``python -m sonar.cluster.wire.memory_table DIR...`` (memory_table.py) for the README's table.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

# No import of config.py: config.validate calls this module (_check_memory), so ``Config`` here is an
# annotation only and the two resolvers come from their own module (tests/test_layout.py: no cycles).
from sonar.cluster.wire.algos import trains_critic
from sonar.cluster.wire.buckets import (CHECKSUM_CHUNK_BYTES, DEFAULT_BUCKET_BYTES, TensorSpec, plan_buckets,
                                        recv_buffer_bytes, send_buffer_bytes)
from sonar.cluster.wire.resolved import broadcast_backend, engine_dtype, vllm_batched_tokens

GIB = 1 << 30
CUDA_OVERHEAD_BYTES = 1 << 30
"""CUDA context + NCCL communicators per GPU process (see the module docstring for the figure's source)."""
DS_REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (``deepspeed/runtime/zero/config.py``),
which ``learner/deepspeed_config.py`` leaves unset."""
LOGITS_COPIES = 3
"""fp32 [tokens, V] tensors alive at once in the logprob head: logits, softmax, gradient."""
DEFAULT_GPU_MEMORY_GIB = 80.0
GPU_MEMORY_ENV = "SONAR_GPU_MEMORY_GIB"
TINY_VOCAB = 4096
"""Vocabulary assumed for the tiny model (``model.path`` unset) whose world tokenizer is built at run
time (a few hundred to a few thousand words); at these sizes the plan is its constants."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_PHASES = {"backward": "backward", "step": "optimizer step", "critic_step": "critic's optimizer step"}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: exact parameter counts (meta device) and its dimensions."""

    params: int
    """Unique parameters N (a tied input/output embedding counted once)."""
    trunk_params: int
    """Parameters of the decoder without its LM head (the PPO critic's trunk)."""
    largest_layer_params: int
    """Parameters of the largest module (its own, not its children's): DeepSpeed's ZeRO-3 term."""
    largest_tensor_params: int
    """Elements of the largest parameter tensor (the embedding): the largest weight-push bucket."""
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    """(name, shape) of every parameter in ``named_parameters()`` order: what the weight push sends, so
    its bucket plan (``weights.plan_buckets``) is the learner's own."""
    linears: tuple[tuple[str, int, int], ...]
    """(module name, in_features, out_features) of every ``nn.Linear`` in ``named_modules()`` order: the
    modules LoRA can target, so its adapters are counted from the model itself (:func:`adapter_tensors`)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    source: str
    """Where the shape came from (a config.json path, or the tiny model's ``model.*`` fields)."""


@dataclass(frozen=True)
class Row:
    """One line of a GPU's plan: bytes, how they were counted, and when they are alive."""

    name: str
    bytes: int
    note: str = ""
    phase: str = "held"
    """held (the whole run) | backward (forward and backward passes) | step (the policy's optimizer
    step) | critic_step (the critic's, apart) | inside (a part of the row above it, not counted again)."""

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class GpuPlan:
    """One GPU of one role: its rows, peak and what is wrong with it (empty: fits)."""

    title: str
    rows: tuple[Row, ...]
    capacity: int
    problems: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    """Lines printed under the rows (CPU memory with offload, KV tokens)."""

    def phase_bytes(self, phase: str) -> int:
        return sum(r.bytes for r in self.rows if r.phase == phase)

    @property
    def phases(self) -> list[str]:
        """The transient phases (never alive together), in row order."""
        return list(dict.fromkeys(r.phase for r in self.rows if r.phase not in ("held", "inside")))

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes, default="held")

    @property
    def total(self) -> int:
        """Peak bytes: the held rows plus the largest transient phase (backward pass, optimizer steps)."""
        return self.phase_bytes("held") + max((self.phase_bytes(ph) for ph in self.phases), default=0)

    @property
    def fits(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class SharedGpuPlan:
    """One GPU that a learner rank shares with its vLLM engine (``cluster.placement=colocated``): one
    :class:`GpuPlan` per phase of an RL step (generation, training, hand-over), never alive together, so
    the GPU's peak is the largest phase's total."""

    title: str
    phases: tuple[GpuPlan, ...]
    capacity: int
    problems: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()

    def phase(self, name: str) -> GpuPlan:
        """The phase whose title starts with ``name`` (generation, training, hand-over)."""
        (g,) = [g for g in self.phases if g.title.startswith(name)]
        return g

    @property
    def peak(self) -> GpuPlan:
        return max(self.phases, key=lambda g: g.total)

    @property
    def total(self) -> int:
        return self.peak.total

    @property
    def fits(self) -> bool:
        return not self.problems


def _format_rows(g: GpuPlan, indent: str, width: int) -> list[str]:
    lines, peak = [], g.peak_phase
    for r in g.rows:
        tag = "" if r.phase in ("held", "inside") else (
            f" [{_PHASES[r.phase]}{'' if r.phase == peak else ', not at the peak'}]")
        lines.append(f"{indent}{r.name:<{width}} {r.gib:6.1f}  {r.note}{tag}".rstrip())
    return lines


@dataclass(frozen=True)
class MemoryPlan:
    """A run's plan: the learner's rank-0 GPU and one vLLM GPU (None: that role uses no GPU), or, in
    colocated placement, the one GPU each learner rank shares with its engine (``colocated``; learner
    and engine are then None), on GPUs of ``gpu_memory_gib`` (``gpu_memory_source`` says where that
    figure came from)."""

    shape: ModelShape
    gpu_memory_gib: float
    gpu_memory_source: str
    learner: Optional[GpuPlan]
    engine: Optional[GpuPlan]
    notes: tuple[str, ...] = ()
    colocated: Optional[SharedGpuPlan] = None

    @property
    def gpus(self) -> tuple:
        return tuple(g for g in (self.learner, self.engine, self.colocated) if g is not None)

    @property
    def fits(self) -> bool:
        return all(g.fits for g in self.gpus)

    def format(self) -> str:
        s = self.shape
        lines = [f"memory plan, per GPU of {self.gpu_memory_gib:.1f} GiB ({self.gpu_memory_source})",
                 f"  model: {s.source}: {s.params:,} parameters ({s.num_layers} layers, hidden {s.hidden_size}, "
                 f"{s.num_heads} heads / {s.num_kv_heads} kv, vocab {s.vocab_size:,}, "
                 f"{'tied' if s.tied else 'untied'} embeddings)"]
        for g in (self.learner, self.engine):
            if g is None:
                continue
            lines.append(f"  {g.title}")
            lines += _format_rows(g, "    ", 34)
            verdict = "fits" if g.fits else "DOES NOT FIT"
            lines.append(f"    {'total':<34} {g.total / GIB:6.1f}  of {g.capacity / GIB:.1f} GiB: {verdict}")
            lines += [f"    {x}" for x in g.extra]
        c = self.colocated
        if c is not None:
            lines.append(f"  {c.title}")
            for ph in c.phases:
                lines.append(f"    {ph.title}")
                lines += _format_rows(ph, "      ", 36)
                lines.append(f"      {'phase total':<36} {ph.total / GIB:6.1f}")
            verdict = "fits" if c.fits else "DOES NOT FIT"
            peak = c.peak.title.split(":")[0]
            lines.append(f"    {'total (peak: ' + peak + ')':<38} {c.total / GIB:6.1f}  of {c.capacity / GIB:.1f} GiB: "
                         f"{verdict}")
            lines += [f"    {x}" for x in c.extra]
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)

    def refusal(self) -> str:
        """Why the plan does not fit, with the figures and the fields to change ("" when it fits)."""
        parts = [p for g in self.gpus for p in g.problems]
        if not parts:
            return ""
        return f"memory plan: {'; '.join(parts)} (each GPU {self.gpu_memory_gib:.1f} GiB, {self.gpu_memory_source})"


class MemoryPlanError(ValueError):
    """A config whose plan does not fit (raised by ``config.validate``); ``plan`` is the whole plan, which
    the CLI prints under the one-line refusal."""

    def __init__(self, plan: MemoryPlan):
        super().__init__(plan.refusal())
        self.plan = plan


# ---------------------------------------------------------------------------------------------- shapes

_SHAPES: dict[tuple, ModelShape] = {}
"""Shapes by (config.json path, mtime, size), or the tiny model's fields."""


class NotReadable(Exception):
    """No shape here: the model's config.json is not on this machine (a Hub id, or the cluster's storage),
    or transformers cannot build the model it describes (the plan is then skipped, never refused)."""


def _count(model) -> tuple[int, int, int, int]:
    """(N, trunk, largest module's own, largest tensor) of a model; ``parameters()`` yields a tied
    tensor once, so N counts it once (DeepSpeed's ``model_to_params`` dedupes by storage instead, which
    the meta device cannot: every meta tensor has data pointer 0)."""
    n = sum(p.numel() for p in model.parameters())
    trunk = sum(p.numel() for p in model.base_model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    biggest = max(p.numel() for p in model.parameters())
    return n, trunk, largest, biggest


def _shape_of(hf_config, source: str) -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    n, trunk, largest, biggest = _count(model)
    tensors = tuple((name, tuple(t.shape)) for name, t in model.named_parameters())
    linears = tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear))
    c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    return ModelShape(
        params=n, trunk_params=trunk, largest_layer_params=largest, largest_tensor_params=biggest, tensors=tensors,
        linears=linears,
        hidden_size=int(c.hidden_size), intermediate_size=int(c.intermediate_size),
        num_layers=int(c.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads), head_dim=head_dim,
        vocab_size=int(c.vocab_size), tied=bool(getattr(c, "tie_word_embeddings", False)), source=source)


def shape_from_dir(path: str | Path) -> ModelShape:
    """The shape of the model whose ``config.json`` is in ``path`` (a directory that may hold only that
    file), cached per (file, mtime, size) so repeated ``validate()`` calls build the meta model once.
    Raises :class:`NotReadable` when the file is not here or transformers cannot build its model,
    ValueError when it is not JSON."""
    conf = Path(path).expanduser() / "config.json"
    try:
        st = conf.stat()
        key = (str(conf.resolve()), st.st_mtime_ns, st.st_size)
    except OSError:
        raise NotReadable(f"{path}/config.json not readable here") from None
    if key in _SHAPES:
        return _SHAPES[key]
    from transformers import AutoConfig

    try:
        json.loads(conf.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise NotReadable(f"{path}/config.json not readable here ({e})") from None
    except ValueError as e:
        raise ValueError(f"model.path={str(path)!r}: {conf} is not valid JSON ({e})") from None
    try:
        hf = AutoConfig.from_pretrained(str(conf.parent))
        shape = _shape_of(hf, str(conf))
    except OSError as e:
        raise NotReadable(f"{path}/config.json not readable here ({' '.join(str(e).split())[:200]})") from None
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        # not the plan's to refuse: the model's loaders report a model they cannot load (``_check_vllm``, the
        # roles); the plan says it was not checked
        import transformers

        raise NotReadable(f"{path}/config.json: transformers {transformers.__version__} cannot build this model on "
                          f"the meta device ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    _SHAPES[key] = shape
    return shape


def shape_from_fields(m) -> ModelShape:
    """The tiny model's shape from ``ModelConfig``'s fields (``actors/model.py:build_policy``'s Llama,
    vocabulary :data:`TINY_VOCAB`)."""
    key = ("tiny", m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.tie_word_embeddings)
    if key not in _SHAPES:
        from transformers import LlamaConfig

        hf = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                         num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                         num_key_value_heads=m.num_heads, max_position_embeddings=m.max_position_embeddings,
                         tie_word_embeddings=m.tie_word_embeddings)
        _SHAPES[key] = _shape_of(hf, f"the tiny model (model.* fields, vocabulary ~{TINY_VOCAB:,})")
    return _SHAPES[key]


def model_shape(cfg: Config) -> ModelShape:
    return shape_from_fields(cfg.model) if not cfg.model.path else shape_from_dir(cfg.model.path)


# ------------------------------------------------------------------------------------------- the plan

def gpu_memory(cfg: Config, environ: Optional[Mapping[str, str]] = None) -> tuple[float, str]:
    """(GiB of each GPU, where the figure came from): ``cluster.gpu_memory_gib``, else
    ``$SONAR_GPU_MEMORY_GIB``, else 80 (assumed)."""
    environ = os.environ if environ is None else environ
    if cfg.cluster.gpu_memory_gib is not None:
        return float(cfg.cluster.gpu_memory_gib), "from cluster.gpu_memory_gib"
    raw = environ.get(GPU_MEMORY_ENV, "").strip()
    if raw:
        try:
            v = float(raw)
        except ValueError:
            v = float("nan")
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"${GPU_MEMORY_ENV}={raw!r} is not a number of GiB > 0 (the memory of each GPU; "
                             "or set cluster.gpu_memory_gib)")
        return v, f"from ${GPU_MEMORY_ENV}"
    return DEFAULT_GPU_MEMORY_GIB, f"assumed: an H100/A100-80G; set cluster.gpu_memory_gib or ${GPU_MEMORY_ENV}"


def uses_gpu(cfg: Config) -> bool:
    return cfg.learner.num_gpus > 0 or cfg.rollout.num_gpus_per_worker > 0


def train_bytes(cfg: Config) -> int:
    """p: bytes per element of the training dtype (``deepspeed_config.resolve_precision`` on a GPU)."""
    L = cfg.learner
    return 2 if L.precision == "bf16" or (L.precision == "auto" and L.num_gpus > 0) else 4


def _fmt_n(n: int) -> str:
    return f"{n / 1e9:.2f}e9" if n >= 1e8 else f"{n / 1e6:.1f}e6"


def _states(n: int, label: str, cfg: Config, p: int, nname: str = "N", step: str = "step") -> list[Row]:
    """Parameters, gradients, master, Adam and the step's fp32 gradients of an n-parameter model under
    the learner's ZeRO stage (the table in the module docstring); ``nname`` names n in the notes."""
    L = cfg.learner
    R, z, off = L.num_ranks, L.zero_stage, L.offload_optimizer
    dt = "bf16" if p == 2 else "fp32"
    by = lambda cond: R if cond else 1  # noqa: E731  (divisor: sharded over the ranks or not)
    cpu = "0 on the GPU: in host memory (optimizer offload)"
    rows = [Row(f"{label}{dt} parameters", p * n // by(z == 3), f"{p} B x {nname}{_shard(by(z == 3))}")]
    rows.append(Row(f"{label}{dt} gradients", 0 if (off and z >= 2) else p * n // by(z >= 2),
                    "0 on the GPU: reduced into the host partition (offload)" if (off and z >= 2)
                    else f"{p} B x {nname}{_shard(by(z >= 2))}"))
    if p == 2:
        rows.append(Row(f"{label}fp32 master weights", 0 if off else 4 * n // by(z >= 1),
                        cpu if off else f"4 B x {nname}{_shard(by(z >= 1))}"))
    rows.append(Row(f"{label}Adam m + v (fp32)", 0 if off else 8 * n // by(z >= 1),
                    cpu if off else f"8 B x {nname}{_shard(by(z >= 1))}"))
    if p == 2:
        rows.append(Row(f"{label}fp32 gradients at the step", 0 if off else 4 * n // by(z >= 1),
                        cpu if off else f"4 B x {nname}{_shard(by(z >= 1))}", phase=step))
    return rows


def _shard(d: int) -> str:
    return "" if d == 1 else f" / {d} ranks"


def _kl_on(cfg: Config) -> bool:
    return any(st.kind == "rl" and st.algo.kl_coef > 0 for st in cfg.stages)


def _critic_on(cfg: Config) -> bool:
    return cfg.critic.mode == "separate" and trains_critic(cfg)


def micro_tokens(cfg: Config) -> int:
    return max(cfg.learner.micro_batch_tokens, cfg.protocol.max_total_tokens)


def activation_bytes(s: ModelShape, tokens: int, p: int, checkpointing: bool) -> int:
    """Activations of one micro-batch of ``tokens`` tokens (module docstring; logits excluded)."""
    H, I, L = s.hidden_size, s.intermediate_size, s.num_layers
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    saved = 8 * H + p * (2 * H + 3 * q + 2 * kv + 4 * I) + 4 * s.num_heads
    in_flight = p * (3 * I + 2 * H)
    final_norm = (4 + p) * H
    if checkpointing:
        return tokens * (L * p * H + final_norm + saved + in_flight)
    return tokens * (L * saved + in_flight + final_norm)


def logits_bytes(s: ModelShape, tokens: int, chunk: int) -> int:
    return min(chunk or tokens, tokens) * s.vocab_size * 4 * LOGITS_COPIES


def lora_of(cfg: Config) -> tuple[int, tuple[str, ...]]:
    """(rank, target modules) of ``learner.lora``; (0, ()) when off (the whole model is trained). Hashable:
    the push's bucket plan is cached by it."""
    lo = cfg.learner.lora
    return (lo.rank, tuple(lo.target_modules)) if lo.rank > 0 else (0, ())


def _lora_tag(cfg: Config) -> str:
    """Appended to the label of a row that LoRA sizes differently (the push's buffers from the adapters alone,
    ZeRO-3's gathered layer without gradients)."""
    return " (LoRA)" if lora_of(cfg)[0] else ""


def adapter_tensors(s: ModelShape, rank: int, targets: Sequence[str]) -> tuple[tuple[str, tuple[int, int]], ...]:
    """(name, shape) of the trained LoRA adapter (peft's ``default``, ``policy.with_lora``) in
    ``named_parameters()`` order: for each ``nn.Linear`` of in x out features whose last name component is
    in ``targets`` (peft matches a list of names against the whole module name or a ``.``-suffix), A [rank,
    in] then B [out, rank], so rank x (in + out) parameters a module, in the base's dtype (no fp32 upcast).
    What the optimizer holds and a weight push moves; the KL reference's adapter has the same shapes."""
    want = set(targets)
    out: list = []
    for name, fin, fout in s.linears:
        if name.rsplit(".", 1)[-1] in want:
            out += [(f"base_model.model.{name}.lora_A.default.weight", (rank, fin)),
                    (f"base_model.model.{name}.lora_B.default.weight", (fout, rank))]
    return tuple(out)


def adapter_params(s: ModelShape, rank: int, targets: Sequence[str]) -> int:
    """A: parameters of one LoRA adapter (sum of rank x (in + out) over the targeted modules)."""
    return sum(math.prod(shape) for _, shape in adapter_tensors(s, rank, targets))


@functools.lru_cache(maxsize=64)
def push_buckets(s: ModelShape, p: int, lora: tuple[int, tuple[str, ...]] = (0, ())) -> list:
    """The weight push's bucket plan in the training dtype (the sender's: receivers take its dtypes) over
    what a push moves: every parameter, or with LoRA (``lora``: :func:`lora_of`) the trained adapter alone
    (``learner/worker.py: _pushed``, the parameters that need a gradient)."""
    import torch

    dtype = torch.bfloat16 if p == 2 else torch.float32
    tensors = adapter_tensors(s, *lora) if lora[0] else s.tensors
    return plan_buckets([TensorSpec(name, shape, dtype) for name, shape in tensors], DEFAULT_BUCKET_BYTES)


def _push_rows(cfg: Config, s: ModelShape, p: int) -> list[Row]:
    """The learner's side of the weight push: NCCL's two send buffers (rank 0); the colocated hand-over's
    send buffers and IPC segment (every rank: each hands over to the engine on its GPU); nothing with gloo
    (a GPU learner flattens every bucket in host memory)."""
    backend = broadcast_backend(cfg)
    if backend == "nccl":
        return [Row("weight push send buffers" + _lora_tag(cfg), send_buffer_bytes(push_buckets(s, p, lora_of(cfg))),
                    f"2 stream buffers of flattened buckets (<= {DEFAULT_BUCKET_BYTES >> 20} MiB), rank 0")]
    if backend == "cuda_ipc":
        buckets = push_buckets(s, p, lora_of(cfg))
        z3 = cfg.learner.zero_stage == 3  # ZeRO-3 pushes through per-bucket gathers: every bucket is flattened
        return [Row("hand-over send buffers" + _lora_tag(cfg), send_buffer_bytes(buckets, in_place=not z3),
                    "2 stream buffers, " + ("every bucket flattened (ZeRO-3 gathers)" if z3 else
                                            f"multi-tensor buckets (<= {DEFAULT_BUCKET_BYTES >> 20} MiB)")),
                Row("hand-over IPC segment" + _lora_tag(cfg), max(b.nbytes for b in buckets),
                    "the largest bucket, mapped by the engine (cluster/transport/handover.py)")]
    return []


def layer_params(s: ModelShape) -> int:
    """Parameters of one decoder layer: (trunk - input embedding - final norm) / layers."""
    return (s.trunk_params - s.vocab_size * s.hidden_size - s.hidden_size) // s.num_layers


def learner_plan(cfg: Config, s: ModelShape, capacity: int) -> GpuPlan:
    L = cfg.learner
    p, R, z = train_bytes(cfg), L.num_ranks, L.zero_stage
    dt, z3 = ("bf16" if p == 2 else "fp32"), (R if z == 3 else 1)
    rank, targets = lora_of(cfg)
    if rank:  # the base frozen (no gradient, no optimizer state); the adapters train like a model of A parameters
        a = adapter_params(s, rank, targets)
        rows = [Row(f"LoRA: frozen base {dt} parameters", p * s.params // z3,
                    f"{p} B x N={_fmt_n(s.params)}{_shard(z3)}, no gradient or optimizer state")]
        rows += _states(a, "LoRA: ", cfg, p, f"A={_fmt_n(a)} (the adapters, rank {rank})")
    else:
        rows = _states(s.params, "", cfg, p, f"N={_fmt_n(s.params)}")
    if z == 3:  # DeepSpeed's largest_layer_memory: the largest module gathered, its bf16 parameters and gradients;
        # under LoRA that module (the embedding) is frozen base: its parameters gathered, no gradient
        per = p if rank else 4
        rows.append(Row("ZeRO-3 gathered layer" + _lora_tag(cfg), per * s.largest_layer_params,
                        f"{per} B x {_fmt_n(s.largest_layer_params)} (largest layer's params"
                        + ("; frozen: no grads)" if rank else " + grads)")))
    if z >= 2:  # allocated whole whatever the trainable count (stage_1_and_2.py setup_buckets, stage3.py)
        rows.append(Row("DeepSpeed reduce bucket", DS_REDUCE_BUCKET_ELEMENTS * p, f"5e8 elements x {p} B"))
    if _kl_on(cfg) and rank:  # a second, frozen adapter on the same base (learner/lora.py), no second model
        rows.append(Row(f"KL reference (LoRA adapter, {dt})", p * a // z3,
                        f"{p} B x A{_shard(z3)}, frozen, beside the trained one"))
    elif _kl_on(cfg):
        rows.append(Row(f"KL reference ({dt})", p * s.params // z3, f"{p} B x N{_shard(z3)}"))
    if _critic_on(cfg):
        nc = s.trunk_params + s.hidden_size + 1
        rows += _states(nc, "critic: ", cfg, p, f"{_fmt_n(nc)} (trunk + head)", step="critic_step")
    rows += _push_rows(cfg, s, p)
    rows.append(Row("CUDA context + NCCL", CUDA_OVERHEAD_BYTES, "constant"))
    T = micro_tokens(cfg)
    ck = L.gradient_checkpointing
    rows.append(Row(f"activations ({'checkpointed' if ck else 'no checkpointing'})",
                    activation_bytes(s, T, p, ck), f"{T:,} tokens x {s.num_layers} layers", phase="backward"))
    chunk = min(L.logits_chunk_tokens or T, T)
    rows.append(Row("logits" + (" (chunked)" if chunk < T else " (unchunked)"),
                    logits_bytes(s, T, L.logits_chunk_tokens),
                    f"{chunk:,} tokens x {s.vocab_size:,} x 4 B x {LOGITS_COPIES}", phase="backward"))
    extra = []
    if L.offload_optimizer:  # master (bf16 only), Adam, fp32 gradient partition; ZeRO-3 also its bf16 gradients
        n = (a if rank else s.params) + (s.trunk_params + s.hidden_size + 1 if _critic_on(cfg) else 0)
        cpu = ((8 + (8 if p == 2 else 4)) + (p if z == 3 else 0)) * n // R
        extra.append(f"host memory per rank (offloaded master, Adam, gradients): {cpu / GIB:.1f} GiB, not checked")
    title = (f"learner rank 0 of {R} (ZeRO-{z}{', optimizer offload' if L.offload_optimizer else ''}, "
             f"{dt}{f', LoRA rank {rank}' if rank else ''}, micro-batch {T:,} tokens)")
    plan = GpuPlan(title, tuple(rows), capacity, extra=tuple(extra))
    if plan.total > capacity:
        plan = dataclasses.replace(plan, problems=(_learner_problem(cfg, s, capacity, plan.total),))
    return plan


def replace_fields(cfg: Config, changes: Mapping[str, object]) -> Config:
    """``cfg`` with dotted fields replaced, e.g. ``{"learner.num_ranks": 8}`` (sections one level deep;
    not validated: the plan's what-ifs and tests use it)."""
    sections: dict[str, dict] = {}
    for k, v in changes.items():
        sec, name = k.split(".")
        sections.setdefault(sec, {})[name] = v
    return dataclasses.replace(cfg, **{sec: dataclasses.replace(getattr(cfg, sec), **kv)
                                       for sec, kv in sections.items()})


def _learner_problem(cfg: Config, s: ModelShape, capacity: int, total: int) -> str:
    """The refusal of a learner plan: its figure, then the single changes that fit (each re-planned),
    or every change with its figure when none alone does."""
    L, cap = cfg.learner, capacity / GIB
    options: list[tuple[str, float]] = []

    def lt(ch: Mapping[str, object]) -> float:  # a what-if's total (its own refusal is not computed)
        return learner_plan(replace_fields(cfg, ch), s, 1 << 62).total / GIB

    for z in sorted({max(L.zero_stage, 2), 3}):  # the fewest ranks at ZeRO-2 (when that shards enough), at ZeRO-3
        for r in (2, 4, 8, 16, 32, 64, 128):
            if r <= L.num_ranks:
                continue
            g = lt({"learner.num_ranks": r, "learner.zero_stage": z})
            if g <= cap:
                options.append((f"raise learner.num_ranks to {r}"
                                + (f" with learner.zero_stage={z}" if z != L.zero_stage else "")
                                + f" ({r} ranks of ZeRO-{z} need {g:.1f} GiB per GPU)", g))
                break
        else:
            options.append((f"raise learner.num_ranks (even 128 ranks of ZeRO-{z} need {g:.1f} GiB per GPU)", g))
    if L.zero_stage < 3 and L.num_ranks > 1:
        g = lt({"learner.zero_stage": 3})
        options.append((f"learner.zero_stage=3 ({L.num_ranks} ranks: {g:.1f} GiB)", g))
    if not L.offload_optimizer:
        z = max(L.zero_stage, 1)
        g = lt({"learner.offload_optimizer": True, "learner.zero_stage": z})
        options.append((f"learner.offload_optimizer=true{'' if z == L.zero_stage else f' with learner.zero_stage={z}'}"
                        f" ({g:.1f} GiB; the optimizer state then needs host memory)", g))
    if not L.lora.rank and not (L.zero_stage == 3 and L.logits_chunk_tokens):  # (config.py refuses that mix)
        # the base frozen: its optimizer state and gradients gone (configs/lora.yaml's rank)
        g = lt({"learner.lora": dataclasses.replace(L.lora, rank=16)})
        options.append((f"train LoRA adapters, learner.lora.rank=16 or --config lora ({g:.1f} GiB)", g))
    if not L.gradient_checkpointing:
        g = lt({"learner.gradient_checkpointing": True})
        options.append((f"learner.gradient_checkpointing=true ({g:.1f} GiB)", g))
    if L.logits_chunk_tokens == 0 or L.logits_chunk_tokens > 1024:
        g = lt({"learner.logits_chunk_tokens": 1024})
        options.append((f"learner.logits_chunk_tokens=1024 ({g:.1f} GiB)", g))
    m, tried = L.micro_batch_tokens // 2, None
    # halve it while that shrinks the micro-batch (never below one protocol.max_total_tokens trajectory)
    while m >= 1024 and max(m, cfg.protocol.max_total_tokens) < micro_tokens(cfg):
        m = max(m, cfg.protocol.max_total_tokens)
        g = lt({"learner.micro_batch_tokens": m})
        tried = (f"lower learner.micro_batch_tokens to {m:,} ({g:.1f} GiB)", g)
        if g <= cap or m == cfg.protocol.max_total_tokens:
            break
        m //= 2
    if tried:
        options.append(tried)
    fitting = [o for o, g in options if g <= cap]
    head = (f"learner rank 0 needs {total / GIB:.1f} GiB per GPU ({L.num_ranks} rank{'s' if L.num_ranks > 1 else ''} "
            f"of ZeRO-{L.zero_stage}), more than the GPU's {cap:.1f} GiB")
    if fitting:
        return f"{head}: {'; or '.join(fitting)}"
    return f"{head}; no single change fits, combine: {'; '.join(o for o, _ in options)}"


def _vllm_activation_bytes(cfg: Config, s: ModelShape, e: int, tp: int) -> int:
    H, I = s.hidden_size, s.intermediate_size
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    per_token = e * (3 * I // tp + 3 * H + (q + 2 * kv) // tp)
    return vllm_batched_tokens(cfg, on_gpu=True) * per_token + cfg.rollout.max_batch_rows * s.vocab_size * 4 * 2


def kv_bytes_per_token(s: ModelShape, e: int, tp: int) -> int:
    kv_heads_per_gpu = max(1, s.num_kv_heads // tp)
    return 2 * s.num_layers * kv_heads_per_gpu * s.head_dim * e


def engine_plan(cfg: Config, s: ModelShape, capacity: int) -> GpuPlan:
    r = cfg.rollout
    e, tp, p = _DTYPE_BYTES[engine_dtype(cfg)], r.tensor_parallel_size, train_bytes(cfg)
    weights = s.params * e // tp
    act = _vllm_activation_bytes(cfg, s, e, tp)
    util_bytes = int(math.ceil(capacity * r.vllm_gpu_memory_utilization))
    if r.vllm_kv_cache_gib > 0:
        kv = int(r.vllm_kv_cache_gib * GIB)
        reserved = weights + act + kv
        how = f"weights + activations + rollout.vllm_kv_cache_gib={r.vllm_kv_cache_gib:g}"
    else:
        reserved = util_bytes
        kv = reserved - weights - act
        how = f"rollout.vllm_gpu_memory_utilization={r.vllm_gpu_memory_utilization:g} x {capacity / GIB:.1f} GiB"
    per_tok = kv_bytes_per_token(s, e, tp)
    tokens = max(kv, 0) // per_tok
    dtype = engine_dtype(cfg)
    nccl = broadcast_backend(cfg) == "nccl"
    recv = recv_buffer_bytes(push_buckets(s, p, lora_of(cfg))) if nccl else 0
    lora = lora_of(cfg)[0] > 0  # an adapter push is copied out of the buffers and loaded from a file: no reload
    held = p * layer_params(s) if nccl and not lora else 0
    rows = (
        Row("vLLM reservation", reserved, how),
        Row(f"  of which weights ({dtype})", weights, f"{e} B x {_fmt_n(s.params)} / TP {tp}", phase="inside"),
        Row("  of which activation peak", act, f"{vllm_batched_tokens(cfg, on_gpu=True):,} batched tokens + sampler",
            phase="inside"),
        Row("  of which KV cache", max(kv, 0), f"{tokens:,} tokens ({per_tok:,} B per token)", phase="inside"),
        Row("broadcast receive buffers" + _lora_tag(cfg), recv,
            "2 stream buffers, each its largest bucket (a tensor, or "
            f"{DEFAULT_BUCKET_BYTES >> 20} MiB)" if nccl else "0 on the GPU: gloo receives in host memory"),
        Row("held copies (layerwise reload)", held, "0: LoRA loads the adapter from a file (no layer reload)"
            if lora else f"<= one decoder layer, {p} B x {_fmt_n(layer_params(s))}" if nccl else "0 on the GPU (gloo)"),
        Row("checksum chunk (float64)", CHECKSUM_CHUNK_BYTES, "weights.CHECKSUM_CHUNK_BYTES"),
        Row("CUDA context + NCCL", CUDA_OVERHEAD_BYTES, "constant"),
    )
    plan = GpuPlan(f"vLLM engine GPU (TP {tp}, {dtype}, {r.num_workers} worker{'s' if r.num_workers > 1 else ''})",
                   rows, capacity)
    outside = recv + held + CHECKSUM_CHUNK_BYTES + CUDA_OVERHEAD_BYTES
    problems = []
    u_max = math.floor((capacity - outside) / capacity * 100) / 100
    if s.num_heads % tp:
        problems.append(f"rollout.tensor_parallel_size={tp} does not divide the model's {s.num_heads} attention heads "
                        f"(vLLM refuses it): use one of {[t for t in (1, 2, 4, 8) if s.num_heads % t == 0]}")
    if plan.total > capacity or util_bytes + CUDA_OVERHEAD_BYTES > capacity:
        problems.append(f"each vLLM GPU needs {max(plan.total, util_bytes + CUDA_OVERHEAD_BYTES) / GIB:.1f} GiB "
                        f"(reservation {reserved / GIB:.1f} + {outside / GIB:.1f} outside it), more than the "
                        f"GPU's {capacity / GIB:.1f} GiB: lower rollout.vllm_gpu_memory_utilization to "
                        f"{u_max:g} or less" + (" and rollout.vllm_kv_cache_gib" if r.vllm_kv_cache_gib > 0 else ""))
    if tokens < cfg.protocol.max_total_tokens:
        fix = []
        for t in (2, 4, 8):
            if t > tp and s.num_heads % t == 0:
                k2 = (util_bytes - s.params * e // t - _vllm_activation_bytes(cfg, s, e, t)
                      if r.vllm_kv_cache_gib == 0 else kv)
                t_tok = max(k2, 0) // kv_bytes_per_token(s, e, t)
                if t_tok >= cfg.protocol.max_total_tokens:
                    fix.append(f"raise rollout.tensor_parallel_size to {t} (with rollout.num_gpus_per_worker={t}: "
                               f"weights {s.params * e / t / GIB:.1f} GiB per GPU, KV for {t_tok:,} tokens)")
                    break
        if r.vllm_kv_cache_gib == 0 and r.vllm_gpu_memory_utilization < u_max:
            fix.append(f"raise rollout.vllm_gpu_memory_utilization (up to {u_max:g})")
        if r.vllm_kv_cache_gib > 0:
            fix.append("raise rollout.vllm_kv_cache_gib")
        problems.append(f"the vLLM reservation ({reserved / GIB:.1f} GiB) less weights "
                        f"({weights / GIB:.1f} GiB per GPU) "
                        f"and activations ({act / GIB:.1f}) leaves KV for {tokens:,} tokens, fewer than one "
                        f"protocol.max_total_tokens={cfg.protocol.max_total_tokens:,} trajectory"
                        + (f": {'; or '.join(fix)}" if fix else ""))
    return dataclasses.replace(plan, problems=tuple(problems))


# ------------------------------------------------------------------------------- colocated placement

def colocated(cfg: Config) -> bool:
    """Whether the plan is colocated: ``cluster.placement=colocated`` with a vLLM engine and a learner on
    GPUs (``config._check_colocated`` refuses any other colocated GPU layout)."""
    return (getattr(cfg.cluster, "placement", "split") == "colocated" and cfg.learner.num_gpus > 0
            and cfg.rollout.num_gpus_per_worker > 0 and cfg.rollout.engine == "vllm")


def _stays_while_generating(name: str) -> bool:
    """Learner rows that ``learner.offload_while_generating`` leaves on the GPU: parameters (policy, critic),
    the KL reference (a frozen module apart from DeepSpeed's engine), the hand-over's buffers, the context.
    The rest (gradients, fp32 master, Adam, ZeRO's reduce bucket and gathered layer) DeepSpeed's
    ``offload_states`` moves to host memory or frees (``empty_cache`` at its end)."""
    return name.endswith(" parameters") or name.startswith(("KL reference", "hand-over ", "CUDA context"))


def _engine_side(cfg: Config, s: ModelShape, capacity: int) -> dict:
    """The engine's figures on a shared GPU (TP 1): weights, activation peak, reservation, KV, buffers."""
    r = cfg.rollout
    e, tp, p = _DTYPE_BYTES[engine_dtype(cfg)], r.tensor_parallel_size, train_bytes(cfg)
    weights, act = s.params * e // tp, _vllm_activation_bytes(cfg, s, e, tp)
    util_bytes = int(math.ceil(capacity * r.vllm_gpu_memory_utilization))
    if r.vllm_kv_cache_gib > 0:
        kv = int(r.vllm_kv_cache_gib * GIB)
        reserved = weights + act + kv
        how = f"weights + activations + rollout.vllm_kv_cache_gib={r.vllm_kv_cache_gib:g}"
    else:
        reserved, how = util_bytes, (f"rollout.vllm_gpu_memory_utilization={r.vllm_gpu_memory_utilization:g} x "
                                     f"{capacity / GIB:.1f} GiB")
        kv = reserved - weights - act
    per_tok = kv_bytes_per_token(s, e, tp)
    return dict(e=e, tp=tp, weights=weights, act=act, util_bytes=util_bytes, reserved=reserved, how=how, kv=kv,
                per_tok=per_tok, tokens=max(kv, 0) // per_tok,
                recv=recv_buffer_bytes(push_buckets(s, p, lora_of(cfg))),
                held=0 if lora_of(cfg)[0] else p * layer_params(s), p=p)  # LoRA: no layer reload


def colocated_plan(cfg: Config, s: ModelShape, capacity: int, check: bool = True) -> SharedGpuPlan:
    """The GPU a learner rank shares with its engine, phase by phase (module docstring, "Colocated
    GPU"); ``check``: also the refusal with the single changes that fit (each re-planned)."""
    L, r = cfg.learner, cfg.rollout
    lp = learner_plan(cfg, s, 1 << 62)  # its rows only: the refusal is this GPU's
    en = _engine_side(cfg, s, capacity)
    dtype = engine_dtype(cfg)
    held = [x for x in lp.rows if x.phase == "held"]
    off = L.offload_while_generating
    ctx = Row("engine CUDA context", CUDA_OVERHEAD_BYTES, "constant")
    recv = Row("engine receive buffers" + _lora_tag(cfg), en["recv"],
               "2 stream buffers, each its largest bucket (kept between pushes)")

    # generation: the engine awake, what the learner keeps beside it
    kept = [x for x in held if not off or _stays_while_generating(x.name)]
    moved = [x for x in held if x not in kept and x.bytes]
    gen_learner = [Row(f"learner: {x.name}", x.bytes, x.note) for x in kept]
    if moved:
        gen_learner.append(Row("learner: in host memory", 0, f"{sum(x.bytes for x in moved) / GIB:.1f} GiB: "
                               "gradients, fp32 master, Adam, ZeRO buffers (DeepSpeed's offload_states)"))
    keeps = ("the learner keeps its parameters, its optimizer states in host memory (learner.offload_while_generating)"
             if off else "the learner keeps every state (learner.offload_while_generating=false)")
    gen = GpuPlan(f"generation: the engine awake; {keeps}",
                  (Row("vLLM reservation", en["reserved"], en["how"]),
                   Row(f"  of which weights ({dtype})", en["weights"], f"{en['e']} B x {_fmt_n(s.params)}",
                       phase="inside"),
                   Row("  of which activation peak", en["act"],
                       f"{vllm_batched_tokens(cfg, on_gpu=True):,} batched tokens + sampler", phase="inside"),
                   Row("  of which KV cache", max(en["kv"], 0),
                       f"{en['tokens']:,} tokens ({en['per_tok']:,} B per token)", phase="inside"),
                   recv, ctx, *gen_learner), capacity)

    # training: the engine asleep (its weights and KV cache released), the learner's whole plan
    level = ("level 1: weights offloaded to host memory, KV cache dropped" if r.sleep_level == 1 else
             "level 2: weights and KV cache dropped")
    train = GpuPlan(f"training: the engine asleep ({level}); the learner's states back",
                    lp.rows + (Row("engine asleep: receive buffers" + _lora_tag(cfg), en["recv"],
                                   "kept between pushes"),
                               Row("engine asleep: CUDA context", CUDA_OVERHEAD_BYTES, "constant")), capacity)

    # hand-over: the engine's weights awake (KV cache not yet), the learner's states still on the GPU
    resident = sum(x.bytes for x in held)
    hand = GpuPlan("hand-over: the engine's weights awake, its KV cache not yet; the learner offloads after",
                   (Row(f"engine weights ({dtype})", en["weights"], f"{en['e']} B x {_fmt_n(s.params)}"
                        + (" (woken from host memory)" if r.sleep_level == 1 else " (allocated, then overwritten)")),
                    recv,
                    Row("engine held copies (layer reload)", en["held"],
                        f"<= one decoder layer, {en['p']} B x {_fmt_n(layer_params(s))}"),
                    Row("engine checksum chunk (float64)", CHECKSUM_CHUNK_BYTES, "weights.CHECKSUM_CHUNK_BYTES"),
                    ctx,
                    Row("learner: resident (as in training)", resident,
                        "the training phase's rows less its transients: states, buffers, context")), capacity)

    title = (f"colocated GPU, one per learner rank ({L.num_ranks}): learner rank 0 of {L.num_ranks} (ZeRO-"
             f"{L.zero_stage}, {'bf16' if en['p'] == 2 else 'fp32'}, micro-batch {micro_tokens(cfg):,} tokens) and "
             f"its vLLM engine (TP {en['tp']}, {dtype}, sleep level {r.sleep_level})")
    keeps = sum(x.bytes for x in kept)
    extra = [f"vLLM's start (vllm/v1/worker/utils.py request_memory): rollout.vllm_gpu_memory_utilization x GPU = "
             f"{en['util_bytes'] / GIB:.1f} GiB must be free beside the learner's {keeps / GIB:.1f} and the engine's "
             f"context: {(keeps + CUDA_OVERHEAD_BYTES + en['util_bytes']) / GIB:.1f} GiB"]
    if r.sleep_level == 1:
        extra.append(f"host memory per engine (its weights while asleep, level 1): {en['weights'] / GIB:.1f} GiB, "
                     "not checked")
    if off and moved:
        extra.append(f"host memory per rank (the learner's states while generating): "
                     f"{sum(x.bytes for x in moved) / GIB:.1f} GiB, not checked")
    extra += list(lp.extra)
    plan = SharedGpuPlan(title, (gen, train, hand), capacity, extra=tuple(extra))
    if check:
        issues = _colocated_issues(cfg, plan, en)
        if issues:
            plan = dataclasses.replace(plan, problems=(_colocated_problem(cfg, s, capacity, issues),))
    return plan


def _learner_keeps(gen: GpuPlan) -> int:
    """What the learner keeps on the GPU while its engine generates (the generation phase's learner rows)."""
    return sum(x.bytes for x in gen.rows if x.name.startswith("learner: "))


def _colocated_issues(cfg: Config, plan: SharedGpuPlan, en: dict) -> list[tuple[str, str]]:
    """What does not fit on a shared GPU, phase by phase: (phase, the figures); [] = it fits."""
    cap, out = plan.capacity, []
    gen, train, hand = plan.phases
    keeps, beside = _learner_keeps(gen), en["recv"] + CUDA_OVERHEAD_BYTES  # the engine's own, outside vLLM's pool
    start = keeps + CUDA_OVERHEAD_BYTES + en["util_bytes"]
    if gen.total > cap:
        out.append(("generation", f"generation needs {gen.total / GIB:.1f} GiB (the vLLM reservation "
                                  f"{en['reserved'] / GIB:.1f}, the engine's buffers and context {beside / GIB:.1f}, "
                                  f"what the learner keeps {keeps / GIB:.1f})"))
    elif start > cap:  # a fixed KV cache: vLLM still asks for the utilisation at start
        out.append(("generation", f"vLLM's start needs rollout.vllm_gpu_memory_utilization x GPU = "
                                  f"{en['util_bytes'] / GIB:.1f} GiB free beside the learner's {keeps / GIB:.1f} and "
                                  f"its context (vllm/v1/worker/utils.py request_memory): {start / GIB:.1f} GiB"))
    if en["tokens"] < cfg.protocol.max_total_tokens:
        out.append(("kv", f"the vLLM reservation ({en['reserved'] / GIB:.1f} GiB) less weights "
                          f"({en['weights'] / GIB:.1f}) and activations ({en['act'] / GIB:.1f}) leaves KV for "
                          f"{en['tokens']:,} tokens, fewer than one protocol.max_total_tokens="
                          f"{cfg.protocol.max_total_tokens:,} trajectory"))
    if train.total > cap:
        out.append(("training", f"training needs {train.total / GIB:.1f} GiB (the learner's peak "
                                f"{(train.total - beside) / GIB:.1f}, the sleeping engine's {beside / GIB:.1f})"))
    if hand.total > cap:
        resident = hand.rows[-1].bytes
        out.append(("hand-over", f"the hand-over needs {hand.total / GIB:.1f} GiB (the learner's resident "
                                 f"{resident / GIB:.1f}, the engine's weights, buffers and context "
                                 f"{(hand.total - resident) / GIB:.1f})"))
    return out


def _colocated_fits(cfg: Config, s: ModelShape, capacity: int) -> tuple[bool, float]:
    """(fits, peak GiB) of a what-if."""
    plan = colocated_plan(cfg, s, capacity, check=False)
    return not _colocated_issues(cfg, plan, _engine_side(cfg, s, capacity)), plan.total / GIB


def _colocated_problem(cfg: Config, s: ModelShape, capacity: int, issues: list[tuple[str, str]]) -> str:
    """The refusal of a shared GPU: each phase's figures, then the single changes that fit (each re-planned),
    or every change with its peak when none alone does."""
    L, r, cap = cfg.learner, cfg.rollout, capacity / GIB
    options: list[tuple[str, bool]] = []

    def try_(label: str, changes: Mapping[str, object]) -> bool:
        ok, peak = _colocated_fits(replace_fields(cfg, changes), s, capacity)
        options.append((f"{label} (peak {peak:.1f} GiB)", ok))
        return ok

    kinds = {kind for kind, _ in issues}
    if kinds & {"generation", "kv"}:
        # the largest utilisation that vLLM's start allows beside the learner and, for a reservation sized by
        # it, that the generation phase's other rows leave room for: lower when the engine takes too much,
        # higher when its KV cache is too small (never lower for a KV cache already too small)
        gen = colocated_plan(cfg, s, capacity, check=False).phases[0]
        room = [capacity - _learner_keeps(gen) - CUDA_OVERHEAD_BYTES]
        if r.vllm_kv_cache_gib == 0:
            room.append(capacity - (gen.total - _engine_side(cfg, s, capacity)["reserved"]))
        u_max = math.floor(min(room) / capacity * 100) / 100
        lower = 0 < u_max < r.vllm_gpu_memory_utilization and "kv" not in kinds
        higher = u_max > r.vllm_gpu_memory_utilization and r.vllm_kv_cache_gib == 0
        if lower or higher:
            try_(f"{'lower' if lower else 'raise'} rollout.vllm_gpu_memory_utilization to {u_max:g}",
                 {"rollout.vllm_gpu_memory_utilization": u_max})
        if r.vllm_kv_cache_gib > 0:
            try_(f"lower rollout.vllm_kv_cache_gib to {r.vllm_kv_cache_gib / 2:g}",
                 {"rollout.vllm_kv_cache_gib": r.vllm_kv_cache_gib / 2})
    if not L.offload_while_generating:
        try_("set learner.offload_while_generating=true", {"learner.offload_while_generating": True})
    if L.zero_stage < 3 and L.num_ranks > 1:
        try_("raise learner.zero_stage to 3", {"learner.zero_stage": 3})
    if not L.offload_optimizer:
        z = max(L.zero_stage, 1)
        try_("learner.offload_optimizer=true" + ("" if z == L.zero_stage else f" with learner.zero_stage={z}"),
             {"learner.offload_optimizer": True, "learner.zero_stage": z})
    more = [n for n in (2, 4, 8, 16, 32, 64) if n > L.num_ranks]
    for n in more:  # more GPUs, the fewest that fit: one engine per learner rank, so the two counts move together
        before = len(options)
        if try_(f"more ranks: learner.num_ranks={n} and rollout.num_workers={n}",
                {"learner.num_ranks": n, "rollout.num_workers": n}) or n == more[-1]:
            break
        del options[before:]
    if not L.gradient_checkpointing:
        try_("learner.gradient_checkpointing=true", {"learner.gradient_checkpointing": True})
    if L.logits_chunk_tokens == 0 or L.logits_chunk_tokens > 1024:
        try_("learner.logits_chunk_tokens=1024", {"learner.logits_chunk_tokens": 1024})
    m = max(L.micro_batch_tokens // 2, cfg.protocol.max_total_tokens)
    if m < micro_tokens(cfg):
        try_(f"lower learner.micro_batch_tokens to {m:,}", {"learner.micro_batch_tokens": m})
    fitting = [o for o, ok in options if ok]
    head = (f"colocated GPU (learner rank 0 of {L.num_ranks} and its vLLM engine) does not fit the GPU's "
            f"{cap:.1f} GiB: " + "; ".join(text for _, text in issues))
    if fitting:
        return f"{head}: {'; or '.join(fitting)}"
    return f"{head}; no single change fits, combine: {'; '.join(o for o, _ in options)}"


def plan(cfg: Config, shape: ModelShape, gpu_gib: float, source: str = "given") -> MemoryPlan:
    """The plan of ``cfg`` for a model of ``shape`` on GPUs of ``gpu_gib`` GiB (pure arithmetic)."""
    capacity = int(gpu_gib * GIB)
    if colocated(cfg):
        return MemoryPlan(shape, gpu_gib, source, None, None, colocated=colocated_plan(cfg, shape, capacity))
    learner = learner_plan(cfg, shape, capacity) if cfg.learner.num_gpus > 0 else None
    engine = None
    notes = []
    if cfg.rollout.num_gpus_per_worker > 0:
        if cfg.rollout.engine == "vllm":
            engine = engine_plan(cfg, shape, capacity)
        else:
            notes.append(f"rollout.engine={cfg.rollout.engine!r} on GPU: its memory is not planned (only vLLM's is)")
    if cfg.learner.num_gpus and cfg.learner.num_gpus < 1:
        notes.append(f"learner.num_gpus={cfg.learner.num_gpus:g}: a GPU shared with other actors; the plan is per rank")
    return MemoryPlan(shape, gpu_gib, source, learner, engine, tuple(notes))


def plan_for(cfg: Config, environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[MemoryPlan], Optional[str]]:
    """(plan, None); (None, "memory plan not checked: ...") when the model's config.json is not on this
    machine; (None, None) when the run uses no GPU."""
    if not uses_gpu(cfg):
        return None, None
    gib, source = gpu_memory(cfg, environ)
    try:
        shape = model_shape(cfg)
    except NotReadable as e:
        return None, f"memory plan not checked: {e}"
    return plan(cfg, shape, gib, source), None


def sync_floor_of(cfg: Config, s: ModelShape):
    """``deadlines.sync_batch_floor`` for this model (its weights and KV bytes per token in the engine's
    dtype) where ``cluster.step_timeout_s`` bounds a whole batch: sync mode on vLLM GPUs; else None."""
    r = cfg.rollout
    if cfg.cluster.mode != "sync" or r.engine != "vllm" or r.num_gpus_per_worker <= 0:
        return None
    from sonar.cluster.wire.deadlines import sync_batch_floor

    e = _DTYPE_BYTES[engine_dtype(cfg)]
    return sync_batch_floor(cfg, e * s.params, 2 * s.num_layers * s.num_kv_heads * s.head_dim * e)


def describe(cfg: Config, environ: Optional[Mapping[str, str]] = None) -> str:
    """What the CLI prints: the plan, the "not checked" line, or "" (no GPU)."""
    p, why = plan_for(cfg, environ)
    if p is None:
        return why or ""
    floor = sync_floor_of(cfg, p.shape)
    if floor is not None:
        return (p.format() + f"\nsync batch deadline: cluster.step_timeout_s={cfg.cluster.step_timeout_s:g} s against "
                f"a floor of {floor.text()} (cluster/wire/deadlines.py)")
    return p.format()
