"""The README's tables of what fits, per model shape and GPU type, from the memory plan
(``cluster/wire/memory.py``): ``python -m sonar.cluster.wire.memory_table DIR...`` prints the split table
(learner GPUs and vLLM GPUs apart), ``--colocated`` the table of 8 shared GPUs (``cluster.placement=
colocated``, the Search-R1 and RAG-R1 presets' layout), and tests/cluster/test_memory_plan.py and
tests/cluster/test_memory_colocated.py keep the README equal to their output. Separate from memory.py
because it builds configs (``Config()``), and config.py calls memory.py."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Mapping, Optional, Sequence

from sonar.cluster.wire.config import Config
from sonar.cluster.wire.memory import (GIB, ModelShape, colocated_plan, engine_plan, kv_bytes_per_token, learner_plan,
                                       replace_fields, shape_from_dir)


TABLE_GPUS = (("80 GB (H100, A100-80G)", 79.1), ("48 GB (L40S)", 44.4), ("40 GB (A100-40G)", 39.4))
"""GPU types of the README table, with the memory torch reports for them (``total_memory``, GiB)."""
TABLE_SCENARIO = {
    "learner.num_gpus": 1.0, "learner.precision": "bf16", "learner.gradient_checkpointing": True,
    "learner.logits_chunk_tokens": 1024, "rollout.engine": "vllm", "rollout.vllm_kv_cache_gib": 0.0,
    "rollout.vllm_dtype": "bfloat16", "protocol.max_total_tokens": 8192,
}
"""What every row of the table assumes (besides the searched fields); an RL stage with a KL term."""
TABLE_HEADROOM = 0.95
"""The table recommends a learner plan only within this share of the GPU: the plan counts live tensors
(and 1.0 GiB of context), and PyTorch's caching allocator fragments some memory besides; ``validate``
refuses only what exceeds the whole GPU."""


def table_config(changes: Mapping[str, object] = {}) -> Config:  # noqa: B006  (read only)
    cfg = replace_fields(Config(), {**TABLE_SCENARIO, **changes})
    stage = dataclasses.replace(cfg.stages[0], algo=dataclasses.replace(cfg.stages[0].algo, kl_coef=1e-3))
    return dataclasses.replace(cfg, stages=[stage])


def _search_learner(s: ModelShape, gib: float, offload: bool):
    for R in (1, 2, 4, 8, 16, 32, 64):
        for z in (2, 3):
            for mbt in (32768, 16384, 8192):
                c = table_config({"learner.num_ranks": R, "learner.zero_stage": z, "learner.micro_batch_tokens": mbt,
                                  "learner.offload_optimizer": offload})
                lp = learner_plan(c, s, int(gib * GIB))
                if lp.total <= TABLE_HEADROOM * gib * GIB:
                    return R, z, mbt, lp.total / GIB
    return None


def _search_engine(s: ModelShape, gib: float):
    for tp in (1, 2, 4, 8):
        if s.num_heads % tp:
            continue
        for util in (0.9, 0.85, 0.8):
            c = table_config({"rollout.tensor_parallel_size": tp, "rollout.num_gpus_per_worker": float(tp),
                              "rollout.vllm_gpu_memory_utilization": util})
            ep = engine_plan(c, s, int(gib * GIB))
            if ep.fits:
                kv = next(r for r in ep.rows if r.name.strip().endswith("KV cache"))
                return tp, util, ep.total / GIB, kv.gib, kv.bytes // kv_bytes_per_token(s, 2, tp)
    return None


def table(dirs: Sequence[str | Path]) -> str:
    """The README's markdown table: for each model directory (its config.json) and each GPU type of
    :data:`TABLE_GPUS`, the fewest learner ranks that fit within :data:`TABLE_HEADROOM` (ZeRO-2 before
    ZeRO-3, the largest micro-batch of 32k/16k/8k tokens), the same with optimizer offload, and the smallest vLLM tensor parallelism (at
    the largest ``vllm_gpu_memory_utilization`` of 0.9/0.85/0.8 that fits)."""
    out = ["| model (parameters) | GPU (GiB) | learner: ranks, ZeRO, micro-batch | learner GiB/GPU | "
           "with optimizer offload | vLLM TP, util | engine GiB/GPU | KV GiB (tokens) |",
           "|---|---|---|---|---|---|---|---|"]
    for d in dirs:
        s = shape_from_dir(d)
        name = f"{Path(d).name} ({s.params / 1e9:.2f}B)"
        for label, gib in TABLE_GPUS:
            lrn = _search_learner(s, gib, offload=False)
            off = _search_learner(s, gib, offload=True)
            eng = _search_engine(s, gib)
            lcell = f"{lrn[0]} x ZeRO-{lrn[1]}, {lrn[2] // 1024}k" if lrn else "no fit (64 ranks)"
            lgib = f"{lrn[3]:.1f}" if lrn else "-"
            ocell = f"{off[0]} x ZeRO-{off[1]}, {off[2] // 1024}k: {off[3]:.1f} GiB" if off else "no fit"
            ecell = f"{eng[0]}, {eng[1]:g}" if eng else "no fit"
            egib = f"{eng[2]:.1f}" if eng else "-"
            kcell = f"{eng[3]:.1f} ({eng[4]:,})" if eng else "-"
            out.append(f"| {name} | {label}: {gib:g} | {lcell} | {lgib} | {ocell} | {ecell} | {egib} | {kcell} |")
    return "\n".join(out)


COLOCATED_SCENARIO = {
    "cluster.placement": "colocated", "cluster.mode": "sync", "learner.num_ranks": 8, "rollout.num_workers": 8,
    "rollout.num_gpus_per_worker": 1.0, "rollout.tensor_parallel_size": 1, "learner.offload_while_generating": True,
    "rollout.sleep_level": 2,
}
"""The colocated table's layout: the presets' (configs/search_r1.yaml, rag_r1.yaml, as the papers' veRL scripts
run): 8 GPUs, each a learner rank and its vLLM engine, the learner's optimizer states in host memory while
the engine generates, the engine asleep at level 2 while the learner trains."""
COLOCATED_UTILS = (0.6, 0.5, 0.4)
"""``rollout.vllm_gpu_memory_utilization`` tried in order: the presets' (and the scripts') 0.6 first."""


def _search_colocated(s: ModelShape, gib: float):
    for util in COLOCATED_UTILS:
        for z in (2, 3):
            for mbt in (32768, 16384, 8192):
                c = table_config({**COLOCATED_SCENARIO, "learner.zero_stage": z, "learner.micro_batch_tokens": mbt,
                                  "rollout.vllm_gpu_memory_utilization": util})
                cp = colocated_plan(c, s, int(gib * GIB))
                if cp.fits and cp.total <= TABLE_HEADROOM * gib * GIB:
                    kv = next(r for r in cp.phases[0].rows if r.name.strip().endswith("KV cache"))
                    return z, mbt, util, cp, kv.gib, kv.bytes // kv_bytes_per_token(s, 2, 1)
    return None


def colocated_table(dirs: Sequence[str | Path]) -> str:
    """The README's colocated table: for each model directory and each GPU type of :data:`TABLE_GPUS`, 8
    shared GPUs as :data:`COLOCATED_SCENARIO`, the first setting that fits within :data:`TABLE_HEADROOM` (the
    utilisation of :data:`COLOCATED_UTILS` in order, then ZeRO-2 before ZeRO-3, then the largest
    micro-batch of 32k/16k/8k tokens), with each phase's GiB."""
    out = ["| model (parameters) | GPU (GiB) | 8 shared GPUs: ZeRO, micro-batch, vLLM util | generation GiB | "
           "training GiB | hand-over GiB | KV GiB (tokens) |",
           "|---|---|---|---|---|---|---|"]
    for d in dirs:
        s = shape_from_dir(d)
        name = f"{Path(d).name} ({s.params / 1e9:.2f}B)"
        for label, gib in TABLE_GPUS:
            got = _search_colocated(s, gib)
            if got is None:
                out.append(f"| {name} | {label}: {gib:g} | no fit (utilisation 0.4, ZeRO-3, 8k) | - | - | - | - |")
                continue
            z, mbt, util, cp, kv_gib, tokens = got
            gen, train, hand = (f"{g.total / GIB:.1f}" for g in cp.phases)
            out.append(f"| {name} | {label}: {gib:g} | ZeRO-{z}, {mbt // 1024}k, {util:g} | {gen} | {train} | {hand} | "
                       f"{kv_gib:.1f} ({tokens:,}) |")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sonar.cluster.wire.memory_table",
                                 description="GPU memory plans of model shapes (config.json directories)")
    ap.add_argument("dirs", nargs="+", metavar="DIR",
                    help="model directories (each with a config.json): print the README's markdown table")
    ap.add_argument("--colocated", action="store_true",
                    help="the colocated table (8 GPUs, each a learner rank and its vLLM engine) instead of the "
                         "split one")
    args = ap.parse_args(argv)
    print(colocated_table(args.dirs) if args.colocated else table(args.dirs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
