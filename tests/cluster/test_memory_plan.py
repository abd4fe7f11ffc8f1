"""The GPU memory plan (issue 21, item 1): pinned against hand arithmetic for the 3B and 7B shapes and
against DeepSpeed's own estimators; refused configs name the fields to change with the figures; the
config verbs print it, and a laptop without the model says what was not checked.

Shapes are the real Qwen2.5-*-Instruct ``config.json`` files' numbers (``tests/fixtures/model_shapes``),
built on the meta device: no weights anywhere."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sonar.cluster.wire import memory as M
from sonar.cluster.wire.config import Config, load_config

SHAPES = Path(__file__).resolve().parents[1] / "fixtures" / "model_shapes"
D7, D3 = SHAPES / "qwen2.5-7b", SHAPES / "qwen2.5-3b"
GIB = 1 << 30
N7, N3 = 7_615_616_512, 3_085_938_688
EMB7 = 152_064 * 3_584  # the 7B's largest tensor and largest module (input embedding = untied LM head)
MIB128 = 128 << 20


def _gib(x: float) -> float:
    return round(x / GIB, 1)


def _cfg(changes: dict) -> Config:
    """A GPU run (learner and engines: an NCCL broadcast) of the default config with ``changes`` (dotted),
    no KL reference, no critic."""
    base = {"learner.num_gpus": 1.0, "learner.precision": "bf16", "learner.gradient_checkpointing": True,
            "learner.logits_chunk_tokens": 1024, "learner.micro_batch_tokens": 32768,
            "protocol.max_total_tokens": 8192, "rollout.engine": "vllm", "rollout.num_gpus_per_worker": 1.0}
    return M.replace_fields(Config(), {**base, **changes})


def _row(gpu: M.GpuPlan, name: str) -> int:
    rows = [r for r in gpu.rows if r.name.strip() == name]
    assert len(rows) == 1, [r.name for r in gpu.rows]
    return rows[0].bytes


def _held_states(gpu: M.GpuPlan) -> int:
    return sum(_row(gpu, n) for n in ("bf16 parameters", "bf16 gradients", "fp32 master weights", "Adam m + v (fp32)"))


# 7B activations at 32,768 tokens with checkpointing, by hand (H=3584, I=18944, L=28, 28 heads, kv 4 x 128):
#   saved per token and layer  8*3584 + 2*(2*3584 + 3*3584 + 2*512 + 4*18944) + 4*28 = 218,224
#   grads in flight            2*(3*18944 + 2*3584)                                  = 128,000
#   kept layer inputs          28 * 2 * 3584                                         = 200,704
#   final norm (fp32 in + out) 6 * 3584                                              =  21,504
ACT7_32K = 32768 * (218_224 + 128_000 + 200_704 + 21_504)
LOGITS7_1K = 1024 * 152_064 * 4 * 3
# A receiver's two stream buffers (bucket i through buffer i % 2): buffer 0 holds the 1.09 GB embedding and
# LM head (buckets 0 and 114, each alone), buffer 1 the largest other bucket, an MLP matrix of 136 MB alone.
RECV7 = EMB7 * 2 + 3584 * 18944 * 2
LAYER7 = (3584 * 3584 + 3584) + 2 * (3584 * 512 + 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584  # q, k/v, o, MLP, norms


def _buckets7():
    import torch

    from sonar.cluster.transport.weights import TensorSpec, plan_buckets

    return plan_buckets([TensorSpec(n, sh, torch.bfloat16) for n, sh in M.shape_from_dir(D7).tensors], MIB128)


def _send7() -> int:
    """The learner's two send buffers: only buckets of more than one tensor are flattened (a bucket of one
    tensor, the embedding or an MLP matrix of 136 MB > 128 MiB, is broadcast from the tensor itself), so
    each buffer is at most 128 MiB."""
    from sonar.cluster.transport.weights import recv_buffer_bytes, send_buffer_bytes

    buckets = _buckets7()
    assert recv_buffer_bytes(buckets) == RECV7  # the weight push's own accounting agrees with the hand figure
    send = send_buffer_bytes(buckets)
    assert 0 < send <= 2 * MIB128 and send <= 2 * max(b.nbytes for b in buckets if len(b.specs) > 1)
    return send


# ------------------------------------------------------------------------------------------- shapes

@pytest.mark.parametrize("name, params, tied", [
    ("qwen2.5-1.5b", 1_543_714_304, True), ("qwen2.5-3b", N3, True),
    ("qwen2.5-7b", N7, False), ("qwen2.5-14b", 14_770_033_664, False)])
def test_the_meta_model_counts_the_published_parameters(name, params, tied):
    s = M.shape_from_dir(SHAPES / name)
    assert (s.params, s.tied) == (params, tied)  # a tied embedding counted once
    raw = json.loads((SHAPES / name / "config.json").read_text())
    assert (s.hidden_size, s.num_layers, s.vocab_size) == (raw["hidden_size"], raw["num_hidden_layers"], raw["vocab_size"])
    lm_head = 0 if tied else raw["vocab_size"] * raw["hidden_size"]
    assert s.trunk_params == params - lm_head
    assert s.largest_tensor_params == s.largest_layer_params == raw["vocab_size"] * raw["hidden_size"]


def test_the_shape_is_cached_per_file_and_mtime(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(D3, d)
    a = M.shape_from_dir(d)
    assert M.shape_from_dir(d) is a  # no second meta model
    raw = json.loads((d / "config.json").read_text())
    raw["num_hidden_layers"] = 35  # one layer fewer, written later: a new mtime
    (d / "config.json").write_text(json.dumps(raw))
    (d / "tokenizer_config.json").write_text("{}")  # validate checks a model dir has its tokenizer
    st = (d / "config.json").stat()
    os.utime(d / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    b = M.shape_from_dir(d)
    layer = 2 * 2048 * 2048 + 2 * 2048 * 256 + 2048 + 2 * 256 + 3 * 2048 * 11008 + 2 * 2048  # q/o, k/v, biases, MLP, norms
    assert a.params - b.params == layer


def test_a_missing_or_unbuildable_config_json_is_not_planned_and_bad_json_is_an_error(tmp_path):
    with pytest.raises(M.NotReadable, match="config.json not readable here"):
        M.shape_from_dir(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text("{}")  # validate checks a model dir has its tokenizer
    with pytest.raises(ValueError, match="not valid JSON"):
        M.shape_from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))  # no model_type
    (tmp_path / "tokenizer_config.json").write_text("{}")  # validate checks a model dir has its tokenizer
    with pytest.raises(M.NotReadable, match="cannot build this model on the meta device"):
        M.shape_from_dir(tmp_path)


# -------------------------------------------------------------------------------- learner, by hand

def test_7b_one_rank_of_zero2_holds_113_gib_of_states_and_is_refused_on_80():
    cfg = _cfg({"learner.num_ranks": 1, "learner.zero_stage": 2})
    p = M.plan(cfg, M.shape_from_dir(D7), 80.0)
    L = p.learner
    assert (_row(L, "bf16 parameters"), _row(L, "bf16 gradients")) == (2 * N7, 2 * N7)  # one rank shards nothing
    assert (_row(L, "fp32 master weights"), _row(L, "Adam m + v (fp32)")) == (4 * N7, 8 * N7)
    assert _held_states(L) == 16 * N7 and _gib(16 * N7) == 113.5
    # At the optimizer step the fp32 gradients (4N = 28.4 GiB) outweigh the backward's 17.3 + 1.7 GiB:
    assert _row(L, "activations (checkpointed)") == ACT7_32K and _row(L, "logits (chunked)") == LOGITS7_1K
    assert _row(L, "weight push send buffers") == _send7()
    total = 16 * N7 + 5 * 10**8 * 2 + _send7() + GIB + max(ACT7_32K + LOGITS7_1K, 4 * N7)
    assert L.total == total and _gib(total) == 143.8
    assert not p.fits
    msg = p.refusal()
    assert "learner rank 0 needs 143.8 GiB per GPU (1 rank of ZeRO-2), more than the GPU's 80.0 GiB" in msg
    assert "raise learner.num_ranks to 4 (4 ranks of ZeRO-2 need" in msg and "learner.offload_optimizer=true" in msg


def test_7b_zero2_over_8_ranks_shards_everything_but_the_parameters():
    p = M.plan(_cfg({"learner.num_ranks": 8, "learner.zero_stage": 2}), M.shape_from_dir(D7), 80.0)
    L = p.learner
    assert _held_states(L) == 2 * N7 + (2 * N7) // 8 + (4 * N7) // 8 + (8 * N7) // 8
    assert _gib(_held_states(L)) == 26.6  # 14.2 + (2 + 4 + 8) / 8 x N
    assert _row(L, "fp32 gradients at the step") == 4 * N7 // 8
    total = _held_states(L) + 10**9 + _send7() + GIB + ACT7_32K + LOGITS7_1K  # the backward is the peak now
    assert L.total == total and _gib(total) == 47.7 and p.fits


def test_7b_zero3_over_8_ranks_shards_the_parameters_and_the_reference():
    cfg = _cfg({"learner.num_ranks": 8, "learner.zero_stage": 3})
    cfg = dataclasses.replace(cfg, stages=[dataclasses.replace(
        cfg.stages[0], algo=dataclasses.replace(cfg.stages[0].algo, kl_coef=1e-3))])
    L = M.plan(cfg, M.shape_from_dir(D7), 80.0).learner
    assert [_row(L, n) for n in ("bf16 parameters", "bf16 gradients", "fp32 master weights", "Adam m + v (fp32)")] == \
        [2 * N7 // 8, 2 * N7 // 8, 4 * N7 // 8, 8 * N7 // 8]
    assert _gib(_held_states(L)) == 14.2  # 16 / 8 x N
    assert _row(L, "ZeRO-3 gathered layer") == 4 * EMB7
    assert _row(L, "KL reference (bf16)") == 2 * N7 // 8
    total = _held_states(L) + 4 * EMB7 + 10**9 + 2 * N7 // 8 + _send7() + GIB + ACT7_32K + LOGITS7_1K
    assert L.total == total and _gib(total) == 39.1


def test_3b_by_hand_unchunked_logits_and_no_checkpointing_and_the_critic():
    s = M.shape_from_dir(D3)
    # 3B: H=2048, I=11008, L=36, 16 heads, kv 2 x 128. Saved per token and layer:
    saved = 8 * 2048 + 2 * (2 * 2048 + 3 * 2048 + 2 * 256 + 4 * 11008) + 4 * 16   # 118,848
    in_flight = 2 * (3 * 11008 + 2 * 2048)                                          #  74,240
    T = 16384
    cfg = _cfg({"learner.num_ranks": 2, "learner.zero_stage": 2, "learner.micro_batch_tokens": T,
                "learner.gradient_checkpointing": False, "learner.logits_chunk_tokens": 0})
    L = M.plan(cfg, s, 80.0).learner
    assert _row(L, "activations (no checkpointing)") == T * (36 * saved + in_flight + 6 * 2048)
    assert _row(L, "logits (unchunked)") == T * 151_936 * 4 * 3  # 27.8 GiB: why the head is chunked
    assert _gib(T * 151_936 * 12) == 27.8
    assert _held_states(L) == 2 * N3 + (2 * N3) // 2 + (4 * N3) // 2 + (8 * N3) // 2
    # PPO with a separate critic: the trunk (all of a tied model) + a scalar head, states like the policy's
    ppo = dataclasses.replace(cfg, stages=[dataclasses.replace(
        cfg.stages[0], algo=dataclasses.replace(cfg.stages[0].algo, name="ppo"))])
    C = M.plan(ppo, s, 80.0).learner
    nc = N3 + 2048 + 1
    assert [_row(C, f"critic: {n}") for n in ("bf16 parameters", "bf16 gradients", "fp32 master weights",
                                              "Adam m + v (fp32)")] == [2 * nc, 2 * nc // 2, 4 * nc // 2, 8 * nc // 2]
    assert _row(C, "critic: fp32 gradients at the step") == 4 * nc // 2  # its own step, apart from the policy's
    assert C.total - L.total == 2 * nc + 2 * nc // 2 + 4 * nc // 2 + 8 * nc // 2  # the backward stays the peak
    head = dataclasses.replace(ppo, critic=dataclasses.replace(ppo.critic, mode="head"))
    assert M.plan(head, s, 80.0).learner.total == L.total  # a head on the policy's trunk: no second model


def test_offload_moves_the_optimizer_state_off_the_gpu():
    s = M.shape_from_dir(D7)
    L = M.plan(_cfg({"learner.num_ranks": 1, "learner.zero_stage": 2, "learner.offload_optimizer": True}), s, 80.0).learner
    assert [_row(L, n) for n in ("bf16 gradients", "fp32 master weights", "Adam m + v (fp32)",
                                 "fp32 gradients at the step")] == [0, 0, 0, 0]
    assert _row(L, "bf16 parameters") == 2 * N7
    assert any("host memory per rank" in x and f"{16 * N7 / GIB:.1f} GiB" in x for x in L.extra)


# ---------------------------------------------------------------- against DeepSpeed's own estimators

def _ds_estimators():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


_STATE_ROWS = ("bf16 parameters", "bf16 gradients", "fp32 master weights", "Adam m + v (fp32)",
               "fp32 gradients at the step")


@pytest.mark.parametrize("ranks", [1, 8, 16])
@pytest.mark.parametrize("offload", [False, True])
def test_model_states_equal_deepspeeds_zero2_estimate(ranks, offload):
    """DeepSpeed 0.19.8 ``estimate_zero2_model_states_mem_needs``: 2N + 18N/R (16-bit params, 16- and
    32-bit gradient partitions, 32-bit master, Adam) and 2N with offload: this plan's state rows, summed
    over both phases, are the same up to the integer division of each row."""
    z2, _ = _ds_estimators()
    cfg = _cfg({"learner.num_ranks": ranks, "learner.zero_stage": 2, "learner.offload_optimizer": offload})
    L = M.plan(cfg, M.shape_from_dir(D7), 80.0).learner
    _, ds_gpu = z2(N7, num_gpus_per_node=ranks, cpu_offload=offload)
    assert abs(sum(_row(L, n) for n in _STATE_ROWS) - ds_gpu) <= 8


@pytest.mark.parametrize("ranks", [8, 16])
@pytest.mark.parametrize("offload", [False, True])
def test_model_states_against_deepspeeds_zero3_estimate(ranks, offload):
    """``estimate_zero3_model_states_mem_needs``: 4 x largest layer + 18N/R (2N/R with optimizer offload).
    Without offload this plan holds 2N/R more: the bf16 gradient partition (``stage3.py``'s
    ``grad_partitions_flat_buffer``, allocated on the GPU in the training dtype), which the estimator
    leaves out; with offload that buffer is on the CPU and the two agree."""
    _, z3 = _ds_estimators()
    s = M.shape_from_dir(D7)
    cfg = _cfg({"learner.num_ranks": ranks, "learner.zero_stage": 3, "learner.offload_optimizer": offload})
    L = M.plan(cfg, s, 80.0).learner
    mine = sum(_row(L, n) for n in _STATE_ROWS) + _row(L, "ZeRO-3 gathered layer")
    _, ds_gpu, _ = z3(N7, s.largest_layer_params, num_gpus_per_node=ranks, cpu_offload=offload,
                      cpu_offload_params=False)
    assert abs(mine - ds_gpu - (0 if offload else 2 * N7 // ranks)) <= 8


# --------------------------------------------------------------------------------------------- LoRA

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # LoraConfig's default
# Qwen2.5-7B's linear modules per layer, (in, out): q, k, v, o (28 heads, 4 KV heads of 128), gate, up, down
LINEAR7 = {"q_proj": (3584, 3584), "k_proj": (3584, 512), "v_proj": (3584, 512), "o_proj": (3584, 3584),
           "gate_proj": (3584, 18944), "up_proj": (3584, 18944), "down_proj": (18944, 3584)}


def _adapter7(r: int, targets=TARGETS) -> int:
    """The closed form: rank r adds A [r, in] and B [out, r], r x (in + out), to each targeted module of 28 layers."""
    return 28 * sum(r * (LINEAR7[m][0] + LINEAR7[m][1]) for m in targets)


A7 = _adapter7(16)
"""The 7B's rank-16 adapter on every linear layer of a block: 40,370,176 parameters, 80.7 MB in bf16 (0.5 %)."""


def _lora(cfg: Config, rank: int = 16) -> Config:
    from sonar.cluster.wire.config import LoraConfig

    return M.replace_fields(cfg, {"learner.lora": LoraConfig(rank=rank)})


def _kl(cfg: Config) -> Config:
    return dataclasses.replace(cfg, stages=[dataclasses.replace(
        cfg.stages[0], algo=dataclasses.replace(cfg.stages[0].algo, kl_coef=1e-3))])


def test_the_lora_adapters_are_counted_on_the_meta_model_as_peft_builds_them():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sonar.cluster.wire.config import LoraConfig
    from sonar.cluster.wire.policy import with_lora

    s = M.shape_from_dir(D7)
    assert M.adapter_params(s, 16, TARGETS) == A7 == 40_370_176
    assert M.adapter_params(s, 64, ("q_proj", "v_proj")) == _adapter7(64, ("q_proj", "v_proj"))
    assert M.adapter_params(s, 16, ("lm_head",)) == 16 * (3584 + 152_064)  # any linear module by its name
    # the learner's own wrapping (policy.with_lora, KL reference included) on the meta device: its trained
    # tensors are the plan's, names, shapes and order, so the push's bucket plan is the learner's
    with torch.device("meta"):
        peft = with_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(D7)), LoraConfig(rank=16), seed=0,
                         reference=True)
    trained = tuple((n, tuple(p.shape)) for n, p in peft.named_parameters() if p.requires_grad)
    assert trained == M.adapter_tensors(s, 16, TARGETS)
    assert sum(p.numel() for n, p in peft.named_parameters() if ".reference." in n) == A7  # the KL reference's


def test_7b_lora_by_hand_the_base_frozen_the_adapters_trained_one_adapter_as_kl_reference():
    """8 ranks of ZeRO-2, a KL term, transformers engines on GPUs (an NCCL push): the base's parameters
    alone for the 7.6e9, the five state rows over the adapter's A, the KL reference one more adapter, the
    push's buffers the adapter's one bucket (80.7 MB < 128 MiB, flattened)."""
    s = M.shape_from_dir(D7)
    full = _kl(_cfg({"learner.num_ranks": 8, "learner.zero_stage": 2, "rollout.engine": "hf"}))
    F, L = M.plan(full, s, 80.0).learner, M.plan(_lora(full), s, 80.0).learner
    assert "LoRA rank 16" in L.title and "LoRA" not in F.title
    assert _row(L, "LoRA: frozen base bf16 parameters") == 2 * N7
    assert [_row(L, f"LoRA: {n}") for n in _STATE_ROWS] == [2 * A7, 2 * A7 // 8, 4 * A7 // 8, 8 * A7 // 8, 4 * A7 // 8]
    assert _row(L, "KL reference (LoRA adapter, bf16)") == 2 * A7 and _row(F, "KL reference (bf16)") == 2 * N7
    assert not any(r.name in _STATE_ROWS or r.name == "KL reference (bf16)" for r in L.rows)  # no full-model rows
    assert _row(L, "weight push send buffers (LoRA)") == 2 * A7 and _row(F, "weight push send buffers") == _send7()
    assert _row(L, "DeepSpeed reduce bucket") == 10**9  # allocated whole whatever the trainable count
    backward = ACT7_32K + LOGITS7_1K  # the same activations: the frozen base still carries the gradient back
    assert (_row(L, "activations (checkpointed)"), _row(L, "logits (chunked)")) == (ACT7_32K, LOGITS7_1K)
    assert L.total == 2 * N7 + 2 * A7 + (2 + 4 + 8) * A7 // 8 + 10**9 + 2 * A7 + 2 * A7 + GIB + backward
    # what LoRA saves: the gradients, master and Adam of N (14 B / 8 ranks), the reference model and the push's
    # buffers, for an adapter's parameters, states, reference and buffers (the base's 2 B x N stays)
    assert F.total - L.total == (14 * N7 // 8 + 2 * N7 + _send7()) - (2 * A7 + 14 * A7 // 8 + 2 * A7 + 2 * A7)
    assert (_gib(F.total), _gib(L.total)) == (61.9, 35.5)
    # ZeRO-3: the base and the reference adapter sharded; the gathered layer (the frozen embedding) has no gradient
    Z = M.plan(_lora(M.replace_fields(full, {"learner.zero_stage": 3})), s, 80.0).learner
    assert _row(Z, "LoRA: frozen base bf16 parameters") == 2 * N7 // 8
    assert _row(Z, "ZeRO-3 gathered layer (LoRA)") == 2 * EMB7
    assert _row(Z, "KL reference (LoRA adapter, bf16)") == 2 * A7 // 8
    # optimizer offload: the host holds the adapter's states, not the model's
    off = M.plan(_lora(M.replace_fields(full, {"learner.offload_optimizer": True})), s, 80.0).learner
    assert any(f"{16 * A7 // 8 / GIB:.1f} GiB" in x for x in off.extra if "host memory per rank" in x)
    # PPO's critic stays a full model: its rows are full fine-tuning's
    ppo = dataclasses.replace(full, stages=[dataclasses.replace(
        full.stages[0], algo=dataclasses.replace(full.stages[0].algo, name="ppo"))])
    critic = lambda g: [(r.name, r.bytes) for r in g.rows if r.name.startswith("critic: ")]  # noqa: E731
    assert critic(M.plan(_lora(ppo), s, 80.0).learner) == critic(M.plan(ppo, s, 80.0).learner) != []


LORA_7B = ["rollout.engine=hf", "rollout.continuous_batching=true", "learner.micro_batch_tokens=8192"]
"""configs/gpu.yaml's learner (8 ranks of ZeRO-2, a KL term, an NCCL push) with the transformers engines on their
GPUs, at 8,192-token micro-batches (one trajectory each)."""


def test_7b_lora_fits_8_gpus_of_40_gb_where_full_fine_tuning_is_refused_and_needs_under_half_on_80():
    """The learner's peak is its states plus the backward's activations; LoRA drops the states to the frozen
    base (14.2 GiB) and the reference to an adapter, and leaves the activations (4.3 + 1.7 GiB here) as they
    are. Per learner GPU: full fine-tuning 48.8 GiB (refused on 40 GB), LoRA rank 16 22.5 GiB (0.46 of it)."""
    over = [f"model.path={D7}"] + LORA_7B
    with pytest.raises(M.MemoryPlanError) as e:
        load_config(["gpu"], over + ["cluster.gpu_memory_gib=40"], notes=[])
    assert "learner rank 0 needs 48.8 GiB per GPU (8 ranks of ZeRO-2), more than the GPU's 40.0 GiB" in str(e.value)
    assert "or train LoRA adapters, learner.lora.rank=16 or --config lora (22.5 GiB)" in str(e.value)  # a way out
    lora40 = load_config(["gpu"], over + ["cluster.gpu_memory_gib=40", "learner.lora.rank=16"], notes=[])
    p40, _ = M.plan_for(lora40, {})
    assert p40.fits and _gib(p40.learner.total) == 22.5
    assert _row(p40.learner, "KL reference (LoRA adapter, bf16)") == 2 * A7  # no second model
    on80 = over + ["cluster.gpu_memory_gib=80"]
    full80 = M.plan_for(load_config(["gpu"], on80, notes=[]), {})[0]
    lora80 = M.plan_for(load_config(["gpu"], on80 + ["learner.lora.rank=16"], notes=[]), {})[0]
    assert full80.fits and _gib(full80.learner.total) == 48.8 and lora80.learner.total == p40.learner.total
    assert 2 * lora80.learner.total < full80.learner.total  # under half the full fine-tune's learner memory


def test_a_vllm_engine_serving_lora_holds_no_reload_copies_and_receives_adapter_sized_buckets():
    """An adapter push is copied out of the receive buffers and loaded from a file (actors/vllm_extension.py):
    no layerwise reload holds a decoder layer's tensors, and the buckets are the adapters'."""
    cfg = _cfg({"rollout.num_gpus_per_worker": 1.0})
    full, lora = M.plan(cfg, M.shape_from_dir(D7), 80.0).engine, M.plan(_lora(cfg), M.shape_from_dir(D7), 80.0).engine
    assert _row(full, "held copies (layerwise reload)") == 2 * LAYER7 and _row(lora, "held copies (layerwise reload)") == 0
    assert 0 < _row(lora, "broadcast receive buffers (LoRA)") < _row(full, "broadcast receive buffers")


# ------------------------------------------------------------------------------------- vLLM, by hand

def test_7b_vllm_gpu_by_hand():
    cfg = _cfg({"rollout.num_gpus_per_worker": 1.0, "rollout.vllm_kv_cache_gib": 0.0,
                "rollout.vllm_gpu_memory_utilization": 0.85, "rollout.max_batch_rows": 64})
    E = M.plan(cfg, M.shape_from_dir(D7), 80.0).engine
    reserved = -(-80 * GIB * 85 // 100)  # ceil(total x 0.85), vLLM's request_memory
    # the profile run: the engine's step budget, 64 decoding rows + one 8,192-token prefill (resolved.vllm_batched_tokens)
    act = (64 + 8192) * 2 * (3 * 18944 + 3 * 3584 + 3584 + 2 * 512) + 64 * 152_064 * 4 * 2
    kv = reserved - 2 * N7 - act
    assert (_row(E, "vLLM reservation"), _row(E, "of which weights (bfloat16)")) == (reserved, 2 * N7)
    assert _row(E, "of which KV cache") == kv
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, layers, kv heads, head dim, bf16
    assert kv // per_token == 985_514 and _gib(kv) == 52.6
    assert M.layer_params(M.shape_from_dir(D7)) == LAYER7
    assert (_row(E, "broadcast receive buffers"), _row(E, "held copies (layerwise reload)")) == (RECV7, 2 * LAYER7)
    outside = RECV7 + 2 * LAYER7 + (32 << 20) + GIB  # receive buckets, a layer's held copies, checksum chunk, CUDA + NCCL
    assert E.total == reserved + outside and E.fits
    too_much = M.plan(M.replace_fields(cfg, {"rollout.vllm_gpu_memory_utilization": 0.99}), M.shape_from_dir(D7), 80.0)
    (msg,) = too_much.engine.problems
    assert _gib(-(-80 * GIB * 99 // 100) + outside) == 81.8 and _gib(outside) == 2.6
    # (80 - 2.6) / 80 = 0.967: the largest utilisation that leaves room for what lives outside vLLM
    assert "each vLLM GPU needs 81.8 GiB (reservation 79.2 + 2.6 outside it)" in msg
    assert "lower rollout.vllm_gpu_memory_utilization to 0.96 or less" in msg


def test_vllm_weights_that_leave_no_kv_room_are_refused_with_the_tensor_parallel_fix():
    s = M.shape_from_dir(SHAPES / "qwen2.5-14b")
    cfg = _cfg({"rollout.num_gpus_per_worker": 1.0, "rollout.vllm_kv_cache_gib": 0.0,
                "rollout.vllm_gpu_memory_utilization": 0.7})
    p = M.plan(cfg, s, 39.4)  # 27.5 GiB of weights in 27.6 GiB, less activations
    assert not p.fits and "fewer than one protocol.max_total_tokens=8,192 trajectory" in p.refusal()
    assert "raise rollout.tensor_parallel_size to 2" in p.refusal()
    tp8 = M.plan(M.replace_fields(cfg, {"rollout.tensor_parallel_size": 8, "rollout.num_gpus_per_worker": 8.0}),
                 M.shape_from_dir(D7), 80.0)
    assert "rollout.tensor_parallel_size=8 does not divide the model's 28 attention heads" in tp8.refusal()


def test_a_fixed_kv_cache_is_weights_plus_activations_plus_kv():
    cfg = _cfg({"rollout.num_gpus_per_worker": 1.0, "rollout.vllm_kv_cache_gib": 8.0})
    E = M.plan(cfg, M.shape_from_dir(D7), 80.0).engine
    assert _row(E, "vLLM reservation") == 2 * N7 + _row(E, "of which activation peak") + 8 * GIB
    assert _row(E, "of which KV cache") == 8 * GIB


# --------------------------------------------------------------------------------- at load, the CLI

def test_gpu_memory_comes_from_the_field_then_the_environment_then_80_assumed():
    cfg = Config()
    assert M.gpu_memory(cfg, {}) == (80.0, "assumed: an H100/A100-80G; set cluster.gpu_memory_gib or $SONAR_GPU_MEMORY_GIB")
    assert M.gpu_memory(cfg, {"SONAR_GPU_MEMORY_GIB": "44.4"}) == (44.4, "from $SONAR_GPU_MEMORY_GIB")
    set_ = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, gpu_memory_gib=39.4))
    assert M.gpu_memory(set_, {"SONAR_GPU_MEMORY_GIB": "44.4"}) == (39.4, "from cluster.gpu_memory_gib")
    with pytest.raises(ValueError, match=r"\$SONAR_GPU_MEMORY_GIB='48GB' is not a number of GiB > 0"):
        M.gpu_memory(cfg, {"SONAR_GPU_MEMORY_GIB": "48GB"})


GPU_7B = ["learner.num_ranks=8", "learner.zero_stage=3", "learner.num_gpus=1", "cluster.gpu_memory_gib=80",
          "learner.micro_batch_tokens=32768", "learner.gradient_checkpointing=true", "learner.logits_chunk_tokens=1024",
          "rollout.num_gpus_per_worker=1", "rollout.tensor_parallel_size=1", "rollout.vllm_kv_cache_gib=0",
          "rollout.vllm_gpu_memory_utilization=0.85"]


def test_the_gpu_preset_with_a_7b_fits_on_8_ranks_of_zero3_and_one_rank_of_zero2_is_refused():
    notes: list = []  # the preset's dataset files live on the cluster's storage
    cfg = load_config(["gpu"], [f"model.path={D7}"] + GPU_7B, notes=notes)
    p, why = M.plan_for(cfg, {})
    assert why is None and p.fits and p.learner.total < 80 * GIB and p.engine.total < 80 * GIB
    with pytest.raises(ValueError) as e:
        load_config(["gpu"], [f"model.path={D7}"] + GPU_7B + ["learner.num_ranks=1", "learner.zero_stage=2"], notes=[])
    msg = str(e.value)
    one = M.plan_for(M.replace_fields(cfg, {"learner.num_ranks": 1, "learner.zero_stage": 2}), {})[0]
    assert isinstance(e.value, M.MemoryPlanError) and e.value.plan.learner.total == one.learner.total
    assert f"learner rank 0 needs {one.learner.total / GIB:.1f} GiB per GPU (1 rank of ZeRO-2)" in msg
    assert "more than the GPU's 80.0 GiB" in msg and "learner.num_ranks" in msg and "learner.offload_optimizer=true" in msg


def test_a_model_not_on_this_machine_is_not_checked_and_never_fails():
    over = ["model.path=Qwen/Qwen2.5-7B-Instruct", "learner.num_gpus=1", "learner.num_ranks=1",
            "learner.zero_stage=2", "world.force=true"]  # one rank of ZeRO-2 would be refused if it were here
    cfg = load_config([], over)
    assert M.plan_for(cfg, {}) == (None, "memory plan not checked: Qwen/Qwen2.5-7B-Instruct/config.json not readable here")


@pytest.mark.slow
def test_the_tiny_cpu_default_plans_nothing_and_imports_no_transformers():
    assert M.plan_for(load_config([]), {}) == (None, None)
    code = ("import sys; from sonar.cluster.wire.config import load_config; load_config([]); "
            "print(any(m in sys.modules for m in ('transformers', 'sonar.cluster.wire.memory')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_the_tiny_model_on_a_gpu_is_planned_from_its_fields():
    cfg = load_config([], ["learner.num_gpus=1"])
    p, why = M.plan_for(cfg, {})
    assert why is None and p.fits and p.engine is None
    s = p.shape
    H, I, L = 128, 384, 2  # the tiny model's defaults; Llama without biases, tied head
    assert s.params == M.TINY_VOCAB * H + L * (4 * H * H + 3 * H * I + 2 * H) + H


def test_validate_and_show_print_the_plan(capsys):
    from sonar.cluster.driver.cli import main

    assert main(["config", "validate", "--config", "gpu", f"model.path={D7}"] + GPU_7B) == 0
    out = capsys.readouterr().out
    assert out.startswith("sonar: config ok (gpu + 12 overrides)")
    assert "memory plan, per GPU of 80.0 GiB (from cluster.gpu_memory_gib)" in out
    assert "learner rank 0 of 8 (ZeRO-3, bf16, micro-batch 32,768 tokens)" in out and "vLLM engine GPU (TP 1" in out
    assert "7,615,616,512 parameters" in out
    assert main(["config", "show", "--config", "gpu", f"model.path={D7}"] + GPU_7B) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["learner"]["num_ranks"] == 8  # the plan is YAML comments: still a config
    assert "# memory plan, per GPU of 80.0 GiB" in out


def test_validate_on_a_laptop_without_the_model_says_what_was_not_checked(capsys):
    from sonar.cluster.driver.cli import main

    assert main(["config", "validate", "--config", "gpu", "model.path=/models/nowhere-7b"]) == 0
    out = capsys.readouterr().out
    assert "memory plan not checked: /models/nowhere-7b/config.json not readable here" in out
    assert main(["config", "validate"]) == 0
    assert "memory plan" not in capsys.readouterr().out  # the tiny CPU preset plans nothing


def test_a_refused_plan_exits_2_with_the_figures_and_the_plan(capsys):
    from sonar.cluster.driver.cli import main

    with pytest.raises(SystemExit) as e:
        main(["config", "validate", "--config", "gpu", f"model.path={D7}"] + GPU_7B
             + ["learner.num_ranks=1", "learner.zero_stage=2"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "sonar: config error: memory plan: learner rank 0 needs" in err and "learner.num_ranks" in err
    assert "total" in err and "DOES NOT FIT" in err  # the whole plan under the one line


def test_train_logs_the_plan_before_it_starts(monkeypatch, caplog):
    import logging

    from sonar.cluster.driver import cli, loop

    seen = []
    monkeypatch.setattr(loop, "train", lambda cfg: seen.append(cfg))  # the run itself is not under test here
    with caplog.at_level(logging.INFO, logger="sonar"):
        assert cli.main(["train", "learner.num_gpus=1", "cluster.gpu_memory_gib=24"]) == 0
    assert len(seen) == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "sonar"]
    assert any(m.startswith("memory plan, per GPU of 24.0 GiB (from cluster.gpu_memory_gib)") and "learner rank 0 of 1"
               in m for m in logged), logged


# ---------------------------------------------------------------------------------- the README table

def test_the_readme_table_is_the_generated_one():
    from sonar.cluster.wire import memory_table

    readme = (Path(__file__).resolve().parents[2] / "cluster" / "README.md").read_text()
    begin, end = "<!-- memory-table:begin -->\n", "<!-- memory-table:end -->"
    assert begin in readme and end in readme, "README.md lost its memory-table markers"
    shown = readme.split(begin, 1)[1].split(end, 1)[0].strip()
    dirs = [SHAPES / n for n in ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b")]
    assert shown == memory_table.table(dirs), ("README.md's memory table is stale: regenerate it with `python -m "
                                    "sonar.cluster.wire.memory_table tests/fixtures/model_shapes/qwen2.5-{1.5b,3b,7b,14b}`")
