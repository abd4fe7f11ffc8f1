"""The colocated memory plan (issue 51): one GPU per learner rank, shared with its vLLM engine, planned
phase by phase (generation, training, hand-over; ``cluster/wire/memory.py``, "Colocated GPU"), pinned
against hand arithmetic for Qwen2.5-3B under the Search-R1 preset; the Search-R1 preset fits 8 x 80 GB,
a 7B on 8 x 24 GB is refused with each phase's figures and the fields to change; vLLM's start rule
(``request_memory``) is checked beside the resident learner; the README's colocated table is the
generated one.

Shapes are the real ``config.json`` numbers (``tests/fixtures/model_shapes``, or written here from the
public Qwen2.5-3B card), built on the meta device: no weights anywhere."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sonar.cluster.wire import memory as M
from sonar.cluster.wire.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "tests" / "fixtures" / "model_shapes"
D3, D7 = SHAPES / "qwen2.5-3b", SHAPES / "qwen2.5-7b"
GIB = 1 << 30
MIB128 = 128 << 20
N3, N7 = 3_085_938_688, 7_615_616_512
EMB3 = 151_936 * 2048 * 2  # bytes of the 3B's (tied) embedding in bf16: its largest push bucket, alone
EMB7 = 152_064 * 3584 * 2  # the 7B's embedding, and its untied LM head
LAYER3 = (2048 * 2048 + 2048) + 2 * (2048 * 256 + 256) + 2048 * 2048 + 3 * 2048 * 11008 + 2 * 2048
"""One 3B decoder layer's parameters: q (with bias), k and v (with bias), o, the MLP's three, two norms."""
QWEN3B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 2048,
          "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
          "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768}
"""The public Qwen2.5-3B shape (its config.json's fields that decide the plan)."""


def _gib(x: float) -> float:
    return round(x / GIB, 1)


def _row(gpu: M.GpuPlan, name: str) -> int:
    rows = [r for r in gpu.rows if r.name.strip() == name]
    assert len(rows) == 1, [r.name for r in gpu.rows]
    return rows[0].bytes


def _preset(name: str, model: Path, *over: str):
    return load_config([name], [f"model.path={model}", *over], notes=[])  # the data files live on the cluster


def _buckets(d: Path):
    import torch

    from sonar.cluster.transport.weights import TensorSpec, plan_buckets

    return plan_buckets([TensorSpec(n, sh, torch.bfloat16) for n, sh in M.shape_from_dir(d).tensors], MIB128)


# ------------------------------------------------------------------------------------------ by hand

def test_3b_under_the_search_r1_preset_by_hand():
    """configs/search_r1.yaml (ZeRO-2 over 8 ranks, KL reference, micro-batch 16,384 tokens, vLLM at 0.6,
    the learner's optimizer states in host memory while generating, sleep level 2) with Qwen2.5-3B on
    80 GiB: each phase's rows and total from the formulas."""
    from sonar.cluster.transport.weights import recv_buffer_bytes, send_buffer_bytes

    cfg = _preset("search_r1", D3)
    p = M.plan(cfg, M.shape_from_dir(D3), 80.0)
    assert p.learner is None and p.engine is None  # one shared GPU, not two
    c = p.colocated
    gen, train, hand = c.phases
    buckets = _buckets(D3)
    assert buckets[0].nbytes == EMB3 and len(buckets[0].specs) == 1  # the embedding alone: the largest bucket
    # the engine's two receive buffers: the embedding's, and the largest other bucket of odd index (<= 128 MiB)
    recv = EMB3 + max(b.nbytes for b in buckets[1::2])
    assert recv_buffer_bytes(buckets) == recv and recv - EMB3 <= MIB128
    send = send_buffer_bytes(buckets)  # ZeRO-2: a one-tensor bucket is sent from the parameter itself
    assert 0 < send <= 2 * MIB128

    # generation: vLLM's reservation, the engine's buffers and context, what the learner keeps
    reserved = -(-80 * GIB * 6 // 10)  # ceil(0.6 x 80 GiB), vLLM's request_memory
    # vLLM's profile run at the engine's step budget (512 decoding rows + one 4,096-token prefill) + its sampler
    act = (512 + 4096) * 2 * (3 * 11008 + 3 * 2048 + 16 * 128 + 2 * 2 * 128) + 512 * 151_936 * 4 * 2
    kv = reserved - 2 * N3 - act
    assert (_row(gen, "vLLM reservation"), _row(gen, "of which weights (bfloat16)")) == (reserved, 2 * N3)
    assert (_row(gen, "of which activation peak"), _row(gen, "of which KV cache")) == (act, kv)
    assert kv // (2 * 36 * 2 * 128 * 2) == 1_203_364  # K and V, layers, kv heads, head dim, bf16
    assert _row(gen, "engine receive buffers") == recv
    kept = {"learner: bf16 parameters": 2 * N3, "learner: KL reference (bf16)": 2 * N3,  # ZeRO-2: neither sharded
            "learner: hand-over send buffers": send, "learner: hand-over IPC segment": EMB3,
            "learner: CUDA context + NCCL": GIB}
    assert {k: _row(gen, k) for k in kept} == kept
    moved = 2 * N3 // 8 + 4 * N3 // 8 + 8 * N3 // 8 + 10**9  # gradients, master, Adam, reduce bucket: on the host
    assert _row(gen, "learner: in host memory") == 0
    assert f"{moved / GIB:.1f} GiB: gradients, fp32 master, Adam" in [r for r in gen.rows if "host" in r.name][0].note
    assert gen.total == reserved + recv + GIB + sum(kept.values()) and _gib(gen.total) == 63.0

    # training: the learner's whole plan beside the sleeping engine (its context and receive buffers)
    held = 2 * N3 + moved + 2 * N3 + send + EMB3 + GIB
    saved = 8 * 2048 + 2 * (2 * 2048 + 3 * 2048 + 2 * 256 + 4 * 11008) + 4 * 16
    in_flight = 2 * (3 * 11008 + 2 * 2048)
    act3 = 16384 * (36 * 2 * 2048 + 6 * 2048 + saved + in_flight)
    logits3 = 1024 * 151_936 * 4 * 3
    assert (_row(train, "activations (checkpointed)"), _row(train, "logits (chunked)")) == (act3, logits3)
    assert _row(train, "engine asleep: CUDA context") == GIB and _row(train, "engine asleep: receive buffers") == recv
    assert train.total == held + max(act3 + logits3, 4 * N3 // 8) + recv + GIB and _gib(train.total) == 28.2

    # hand-over: the engine's weights alone (no KV cache yet) beside the learner's resident states
    assert M.layer_params(M.shape_from_dir(D3)) == LAYER3
    assert _row(hand, "learner: resident (as in training)") == held
    assert hand.total == 2 * N3 + recv + 2 * LAYER3 + (32 << 20) + GIB + held and _gib(hand.total) == 26.8

    assert c.total == gen.total and c.peak is gen and c.fits and p.fits
    start = sum(kept.values()) + GIB + reserved  # vLLM's start: 0.6 x GPU free beside the learner and its context
    assert any(f"= 48.0 GiB must be free beside the learner's {sum(kept.values()) / GIB:.1f}" in x
               and x.endswith(f"{start / GIB:.1f} GiB") for x in c.extra)
    assert any(f"host memory per rank (the learner's states while generating): {moved / GIB:.1f} GiB" in x
               for x in c.extra)


def test_without_offload_while_generating_the_learner_keeps_every_state_during_generation():
    cfg = _preset("search_r1", D3, "learner.offload_while_generating=false")
    c = M.plan(cfg, M.shape_from_dir(D3), 80.0).colocated
    gen, train, _ = c.phases
    learner_held = sum(r.bytes for r in train.rows if r.phase == "held" and not r.name.startswith("engine"))
    assert sum(r.bytes for r in gen.rows if r.name.startswith("learner: ")) == learner_held
    assert not any(r.name == "learner: in host memory" for r in gen.rows)
    on = M.plan(_preset("search_r1", D3), M.shape_from_dir(D3), 80.0).colocated
    assert gen.total - on.phases[0].total == 2 * N3 // 8 + 4 * N3 // 8 + 8 * N3 // 8 + 10**9
    assert c.phases[1].total == on.phases[1].total and c.phases[2].total == on.phases[2].total  # only generation moves


def test_sleep_level_1_keeps_the_engines_weights_in_host_memory():
    c = M.plan(_preset("search_r1", D3, "rollout.sleep_level=1"), M.shape_from_dir(D3), 80.0).colocated
    assert "level 1: weights offloaded to host memory" in c.phases[1].title
    assert any(x.startswith(f"host memory per engine (its weights while asleep, level 1): {2 * N3 / GIB:.1f} GiB")
               for x in c.extra)
    assert c.total == M.plan(_preset("search_r1", D3), M.shape_from_dir(D3), 80.0).colocated.total  # same GPU bytes


# ------------------------------------------------------------------------------------ fits, refused

def test_the_search_r1_preset_with_qwen2_5_3b_plans_8_colocated_gpus_that_fit_80_gb(tmp_path, capsys):
    from sonar.cluster.driver.cli import main

    (tmp_path / "config.json").write_text(json.dumps(QWEN3B))
    (tmp_path / "tokenizer_config.json").write_text("{}")  # validate checks a model dir has its tokenizer
    assert M.shape_from_dir(tmp_path).params == N3
    assert main(["config", "validate", "--config", "search_r1", f"model.path={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sonar: config ok (search_r1 + 1 overrides)")
    assert "colocated GPU, one per learner rank (8): learner rank 0 of 8 (ZeRO-2, bf16, micro-batch 16,384 tokens)" \
           " and its vLLM engine (TP 1, bfloat16, sleep level 2)" in out
    for phase in ("    generation: the engine awake", "    training: the engine asleep", "    hand-over: "):
        assert phase in out, phase
    assert "    total (peak: generation)                 63.0  of 80.0 GiB: fits" in out
    assert "vLLM engine GPU" not in out and "learner rank 0 of 8 (ZeRO-2" not in out.split("colocated GPU")[0]
    assert main(["config", "show", "--config", "search_r1", f"model.path={tmp_path}"]) == 0
    assert "#     hand-over: the engine's weights awake" in capsys.readouterr().out  # YAML comments, still a config


def test_a_7b_on_8_gpus_of_24_gb_is_refused_with_each_phase_and_its_figures():
    """configs/rag_r1.yaml (ZeRO-3, PPO critic, KL reference) with Qwen2.5-7B on 24 GiB: vLLM's 0.6 x 24 GiB
    does not even hold the weights, and the learner's phases exceed the GPU; no single change fits."""
    from sonar.cluster.transport.weights import recv_buffer_bytes

    with pytest.raises(M.MemoryPlanError) as e:
        _preset("rag_r1", D7, "cluster.gpu_memory_gib=24")
    msg, c = str(e.value), e.value.plan.colocated
    gen, train, hand = c.phases
    recv7 = recv_buffer_bytes(_buckets(D7))
    assert recv7 == EMB7 + 3584 * 18944 * 2  # the embedding and LM head through buffer 0, an MLP matrix through 1
    nc = 7_615_616_512 - EMB7 // 2 + 3584 + 1  # the critic: the trunk (no LM head) and a scalar head
    kept = 2 * N7 // 8 + 2 * N7 // 8 + 2 * nc // 8 + recv7 + EMB7 + GIB  # params, KL, critic params, send (ZeRO-3:
    assert _row(gen, "learner: hand-over send buffers") == recv7  # every bucket flattened), segment, context
    assert _row(gen, "learner: hand-over IPC segment") == EMB7
    reserved = -(-24 * GIB * 6 // 10)
    assert gen.total == reserved + recv7 + GIB + kept
    assert msg.startswith("memory plan: colocated GPU (learner rank 0 of 8 and its vLLM engine) does not fit the "
                          "GPU's 24.0 GiB: ")
    assert (f"generation needs {gen.total / GIB:.1f} GiB (the vLLM reservation {reserved / GIB:.1f}, the engine's "
            f"buffers and context {(recv7 + GIB) / GIB:.1f}, what the learner keeps {kept / GIB:.1f})") in msg
    assert "generation needs 24.9 GiB (the vLLM reservation 14.4, the engine's buffers and context 2.1, what " \
           "the learner keeps 8.3)" in msg
    assert "leaves KV for 0 tokens, fewer than one protocol.max_total_tokens=8,192 trajectory" in msg
    assert f"training needs {_gib(train.total)} GiB" in msg and f"the hand-over needs {_gib(hand.total)} GiB" in msg
    assert (_gib(train.total), _gib(hand.total)) == (47.8, 52.0)
    assert "no single change fits, combine: " in msg and "learner.offload_optimizer=true (peak" in msg
    assert "more ranks: learner.num_ranks=64 and rollout.num_workers=64" in msg
    assert "(each GPU 24.0 GiB, from cluster.gpu_memory_gib)" in msg


def test_a_single_change_that_fits_is_named_and_does_fit():
    with pytest.raises(M.MemoryPlanError) as e:
        _preset("search_r1", D3, "cluster.gpu_memory_gib=24")
    msg = str(e.value)
    assert "generation needs 29.4 GiB" in msg and "training needs 28.2 GiB" in msg
    assert msg.endswith(": raise learner.zero_stage to 3 (peak 19.8 GiB) (each GPU 24.0 GiB, from "
                        "cluster.gpu_memory_gib)")
    cfg = _preset("search_r1", D3, "cluster.gpu_memory_gib=24", "learner.zero_stage=3")  # it fits as named
    assert _gib(M.plan_for(cfg, {})[0].colocated.total) == 19.8


def test_vllm_start_rule_counts_the_resident_learner_even_with_a_fixed_kv_cache():
    """vLLM asks for utilisation x GPU free at start whatever ``kv_cache_memory_bytes``
    (``vllm/v1/worker/gpu_worker.py`` calls ``request_memory`` first): 0.9 x 80 GiB beside a learner that
    keeps 13.3 GiB is refused, though the generation phase (a fixed 8 GiB KV cache) is small."""
    with pytest.raises(M.MemoryPlanError) as e:
        _preset("search_r1", D3, "cluster.gpu_memory_gib=80", "rollout.vllm_kv_cache_gib=8",
                "rollout.vllm_gpu_memory_utilization=0.9")
    msg = str(e.value)
    assert e.value.plan.colocated.phases[0].total < 40 * GIB
    assert ("vLLM's start needs rollout.vllm_gpu_memory_utilization x GPU = 72.0 GiB free beside the learner's 13.3 "
            "and its context (vllm/v1/worker/utils.py request_memory): 86.3 GiB") in msg
    # (80 - 13.3 - 1.0) / 80 = 0.82: the largest utilisation that starts beside the learner
    assert "lower rollout.vllm_gpu_memory_utilization to 0.82" in msg
    _preset("search_r1", D3, "cluster.gpu_memory_gib=80", "rollout.vllm_kv_cache_gib=8",
            "rollout.vllm_gpu_memory_utilization=0.82")


def test_split_placement_is_planned_as_before():
    """The colocated rows appear only in colocated placement: the async overlay (split, 16 GPUs) plans a
    learner GPU and a vLLM GPU, the learner's push over NCCL."""
    cfg = load_config(["search_r1", "async"], [f"model.path={D3}"], notes=[])
    p = M.plan(cfg, M.shape_from_dir(D3), 80.0)
    assert p.colocated is None and p.learner is not None and p.engine is not None
    assert any(r.name == "weight push send buffers" for r in p.learner.rows)
    assert not any(r.name.startswith("hand-over") for r in p.learner.rows)


# ---------------------------------------------------------------------------------- the README table

def test_the_readme_colocated_table_is_the_generated_one():
    from sonar.cluster.wire import memory_table

    readme = (ROOT / "cluster" / "README.md").read_text()
    begin, end = "<!-- memory-table-colocated:begin -->\n", "<!-- memory-table-colocated:end -->"
    assert begin in readme and end in readme, "README.md lost its colocated memory-table markers"
    shown = readme.split(begin, 1)[1].split(end, 1)[0].strip()
    dirs = [SHAPES / n for n in ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.1-8b")]
    assert shown == memory_table.colocated_table(dirs), (
        "README.md's colocated memory table is stale: regenerate it with `python -m sonar.cluster.wire.memory_table "
        "--colocated tests/fixtures/model_shapes/{qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b,llama-3.1-8b}`")


def test_the_colocated_table_rows_fit_and_use_the_presets_layout():
    from sonar.cluster.wire import memory_table as T

    s = M.shape_from_dir(D3)
    z, mbt, util, c, _, _ = T._search_colocated(s, 79.1)
    assert (z, mbt, util) == (2, 32768, 0.6) and c.fits and c.total <= T.TABLE_HEADROOM * 79.1 * GIB
    assert T._search_colocated(M.shape_from_dir(SHAPES / "llama-3.1-8b"), 39.4) is None
