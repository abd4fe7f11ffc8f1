"""learner: tokens/s and peak memory of one learner step, chunked logits against unchunked, 1 against 2 ranks.

Question (issue 12): what does ``learner.logits_chunk_tokens`` save, and what does it cost, at the tiny
world's vocabulary (about 200 tokens) and at Qwen's (151,936); and what does a second data-parallel rank
(``learner.num_ranks=2``) give on this machine?

One *step* is Sonar's own ``train_step.rl_step`` (GRPO, groups of 4 with rewards [1, 0, 0, 1], one
optimizer step: forward, backward and DeepSpeed's AdamW step) through a DeepSpeed engine
(``deepspeed_config(LearnerConfig)``, ZeRO stage ``--zero-stage``), every token of the step in one
micro-batch (``micro_batch_tokens`` = the step's tokens, so unchunked means ``tokens x vocab`` float32
logits at once). The model is the tiny policy's trunk (``ModelConfig`` defaults: hidden 128, 2 layers,
tied embeddings; ``--model H,L,HEADS,I`` sets hidden size, layers, heads and MLP width, e.g. ``512,8,8,1408``
for the 25.8M-parameter policy that ``rollout-scaling --engine vllm`` decodes) with the vocabulary set to 200
or 151,936 (``--vocabs``). With 2 ranks the rows are split across the
ranks by ``rl_step(dp=(rank, 2))`` exactly as the learner does (``_rank_micro_batches``); the ranks are
two processes on a gloo group built by the learner's own ``_init_process_group_on_loopback``.

Measurements, per (vocabulary, chunk, ranks), after ``warmup`` untimed steps, over ``repeats`` steps:
- ``tokens_per_s``: the step's tokens (all ranks together) / the step's wall time (the slowest rank's).
- ``peak_mb``: on CPU the process's peak RSS during the step minus its RSS just before it (Linux: the
  high-water mark is reset through ``/proc/self/clear_refs`` before each step; glibc's mmap threshold
  is pinned at 128 KiB with ``MALLOC_MMAP_THRESHOLD_`` so freed tensors leave the RSS), the largest over
  the ranks. On CUDA ``torch.cuda.max_memory_allocated`` minus the allocation before the step.
  (tracemalloc does not see torch's allocations.)
- ratios inside the run: ``unchunked_over_chunked`` peak memory and time, ``two_over_one_rank`` tokens/s.

Every rank count runs in its own worker process(es) that build each setting's model and engine in turn,
so an unchunked 151,936-token setting's pages do not count against the next one. Simplifications: one
micro-batch per step (the learner packs several when the step has more tokens than its budget); the
2-rank runs share this machine's cores with each other, so on 2 cores they measure contention as much
as parallelism.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sonar.bench.common import base_parser, setup_env, summarise, write_result

setup_env()

NAME = "learner"
TINY_VOCAB, QWEN_VOCAB = 200, 151_936
GROUP = 4
FULL = {"vocabs": [TINY_VOCAB, QWEN_VOCAB], "chunks": [0, 1024], "ranks": [1, 2], "groups": 4, "seq_len": 256,
        "warmup": 1, "repeats": 3, "zero_stage": 0}
QUICK = {"vocabs": [TINY_VOCAB, QWEN_VOCAB], "chunks": [0, 32], "ranks": [1, 2], "groups": 1, "seq_len": 64,
         "warmup": 1, "repeats": 1, "zero_stage": 0}
MMAP_THRESHOLD = 128 * 1024


def _label(v: int) -> str:
    return "152k" if v == QWEN_VOCAB else str(v)


# ------------------------------------------------------------------------------------------ worker side
def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _groups(n_groups: int, seq_len: int, vocab: int, seed: int):
    import numpy as np

    from sonar.cluster.wire.protocol import Segment, SegmentKind, Trajectory

    rng = np.random.default_rng(seed)
    p = max(1, seq_len // 4)
    out = []
    for g in range(n_groups):
        rows = []
        for i, r in enumerate((1.0, 0.0, 0.0, 1.0)[:GROUP]):
            m1 = max(1, (seq_len - p) // 3)
            ret = max(1, (seq_len - p) // 3)
            m2 = max(1, seq_len - p - m1 - ret)
            segs = [Segment(SegmentKind.PROMPT, rng.integers(3, vocab, p)),
                    Segment(SegmentKind.MODEL, rng.integers(3, vocab, m1), rng.normal(size=m1).astype("float32") - 3, 0),
                    Segment(SegmentKind.RETRIEVAL, rng.integers(3, vocab, ret)),
                    Segment(SegmentKind.MODEL, rng.integers(3, vocab, m2), rng.normal(size=m2).astype("float32") - 3, 0)]
            rows.append(Trajectory(f"g{g}-{i}", f"g{g}", f"g{g}", 0, segs, reward=r))
        out.append(rows)
    return out


def _one_setting(vocab: int, chunk: int, spec: dict, rank: int, world: int, device: str) -> dict:
    import gc

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sonar.cluster.wire.config import AlgoConfig, LearnerConfig, ModelConfig, ReplayConfig
    from sonar.learner.deepspeed_config import deepspeed_config
    from sonar.learner.train_step import DeepSpeedStepper, rl_step
    from sonar.learner.worker import _import_deepspeed_without_shm_jit

    ds = _import_deepspeed_without_shm_jit()
    mc = spec["model"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=mc["hidden_size"], intermediate_size=mc["intermediate_size"],
        num_hidden_layers=mc["num_layers"], num_attention_heads=mc["num_heads"], num_key_value_heads=mc["num_heads"],
        max_position_embeddings=max(ModelConfig().max_position_embeddings, spec["seq_len"]), tie_word_embeddings=True))
    params = sum(p.numel() for p in model.parameters())
    on_gpu = device == "cuda"
    groups = _groups(spec["groups"], spec["seq_len"], vocab, seed=1)
    tokens = sum(t.num_tokens() for g in groups for t in g)
    lcfg = LearnerConfig(zero_stage=spec["zero_stage"], micro_batch_tokens=max(tokens, 1), logits_chunk_tokens=chunk,
                         grad_clip=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.99))
    engine, *_ = ds.initialize(model=model, optimizer=opt, config=deepspeed_config(lcfg, on_gpu))
    stepper = DeepSpeedStepper(engine, spec["zero_stage"])
    dev = engine.device

    def step() -> float:
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rl_step(stepper, groups, [0] * len(groups), AlgoConfig(), lcfg, ReplayConfig(), 1.0, 0, device=dev,
                dp=(rank, world))
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(spec["warmup"]):
        step()
    times, peaks = [], []
    for _ in range(spec["repeats"]):
        gc.collect()
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            _reset_peak()
            base = _rss_kb("VmRSS") * 1024
        if world > 1:
            torch.distributed.barrier()
        times.append(step())
        peak = torch.cuda.max_memory_allocated() if on_gpu else _rss_kb("VmHWM") * 1024
        peaks.append((peak - base) / 2**20)
    del engine, stepper, opt, model
    gc.collect()
    return {"vocab": vocab, "chunk": chunk, "tokens": tokens, "params": params, "times": times, "peak_mb": peaks}


def worker(spec_path: str, rank: int) -> int:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    world = spec["world"]
    device = spec["device"]
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world))
    from sonar.learner.worker import _init_process_group_on_loopback

    _init_process_group_on_loopback("nccl" if device == "cuda" else "gloo", rank, world, spec["port"])
    results = [_one_setting(v, c, spec, rank, world, device) for v in spec["vocabs"] for c in spec["chunks"]]
    Path(spec["out"].format(rank=rank)).write_text(json.dumps({"rank": rank, "results": results}))
    torch.distributed.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------ driver side
def _model_spec(text: str | None) -> dict:
    """``H,L,HEADS,I`` (None: the tiny policy's ``ModelConfig``) as the worker's model fields."""
    import argparse

    from sonar.cluster.wire.config import ModelConfig

    if text is None:
        mc = ModelConfig()
        return {"hidden_size": mc.hidden_size, "num_layers": mc.num_layers, "num_heads": mc.num_heads,
                "intermediate_size": mc.intermediate_size}
    try:
        h, n, heads, inter = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--model {text!r}: expected four integers H,L,HEADS,I") from None
    if min(h, n, heads, inter) < 1 or h % heads:
        raise argparse.ArgumentTypeError(f"--model {text!r}: every field must be >= 1 and H a multiple of HEADS")
    return {"hidden_size": h, "num_layers": n, "num_heads": heads, "intermediate_size": inter}


def run_ranks(cfg: dict, world: int, device: str, tmp: Path, timeout_s: float) -> list[dict]:
    """Start ``world`` worker processes (one per rank) for every (vocab, chunk) setting; their results."""
    from sonar.learner.worker import free_port

    spec = {k: cfg[k] for k in ("vocabs", "chunks", "groups", "seq_len", "warmup", "repeats", "zero_stage", "model")}
    spec.update(world=world, device=device, port=free_port(), out=str(tmp / f"w{world}-r{{rank}}.json"))
    spec_path = tmp / f"spec-{world}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "sonar.bench.learner_bench", "--worker", str(spec_path), str(r)],
                              env=env) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise RuntimeError(f"learner bench worker (world {world}) exited with {rc}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(Path(spec["out"].format(rank=r)).read_text()) for r in range(world)]


def collect(cfg: dict, by_world: dict[int, list[dict]], metrics: dict, rows: list[dict]) -> None:
    for world, ranks in by_world.items():
        for i, res in enumerate(ranks[0]["results"]):
            per_rank = [r["results"][i] for r in ranks]
            times = [max(r["times"][k] for r in per_rank) for k in range(len(res["times"]))]
            peaks = [max(r["peak_mb"][k] for r in per_rank) for k in range(len(res["peak_mb"]))]
            key = f"vocab={_label(res['vocab'])}/chunk={res['chunk']}/ranks={world}"
            metrics[f"{key}/tokens_per_s"] = summarise(res["tokens"] / t for t in times)
            metrics[f"{key}/step_s"] = summarise(times)
            metrics[f"{key}/peak_mb"] = summarise(peaks)
            rows.append({"vocab": res["vocab"], "chunk": res["chunk"], "ranks": world, "tokens": res["tokens"],
                         "params": res["params"], "step_s": times, "peak_mb": peaks,
                         "unchunked_logits_mb": res["tokens"] * res["vocab"] * 4 / 2**20})
    chunked = [c for c in cfg["chunks"] if c > 0]
    for v in cfg["vocabs"]:
        for world in by_world:
            base = f"vocab={_label(v)}/chunk=0/ranks={world}"
            for c in chunked:
                other = f"vocab={_label(v)}/chunk={c}/ranks={world}"
                if f"{base}/peak_mb" in metrics and f"{other}/peak_mb" in metrics:
                    metrics[f"vocab={_label(v)}/ranks={world}/unchunked_over_chunk{c}/peak_mb"] = summarise(
                        [metrics[f"{base}/peak_mb"]["median"] / max(metrics[f"{other}/peak_mb"]["median"], 1e-9)])
                    metrics[f"vocab={_label(v)}/ranks={world}/unchunked_over_chunk{c}/step_s"] = summarise(
                        [metrics[f"{base}/step_s"]["median"] / metrics[f"{other}/step_s"]["median"]])
        if 1 in by_world and 2 in by_world:
            for c in cfg["chunks"]:
                one, two = (f"vocab={_label(v)}/chunk={c}/ranks={w}/tokens_per_s" for w in (1, 2))
                metrics[f"vocab={_label(v)}/chunk={c}/two_over_one_rank/tokens_per_s"] = summarise(
                    [metrics[two]["median"] / metrics[one]["median"]])


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"V={_label(r['vocab'])}\nchunk={r['chunk']}\nranks={r['ranks']}" for r in rows]
    xs = range(len(rows))
    axes[0].bar(xs, [sorted(r["peak_mb"])[len(r["peak_mb"]) // 2] for r in rows], color="tab:red")
    axes[0].set_ylabel("peak memory of a step (MB, largest rank)")
    axes[1].bar(xs, [r["tokens"] / sorted(r["step_s"])[len(r["step_s"]) // 2] for r in rows], color="tab:blue")
    axes[1].set_ylabel("tokens/s (all ranks)")
    for ax in axes:
        ax.set_xticks(list(xs), labels, fontsize=7)
    fig.suptitle("learner step: chunked logits vs unchunked, 1 vs 2 ranks")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# bench/README.md's rendering of a result (pure: no runs; `sonar bench readme`, tests/bench/test_readme_blocks.py)

def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's learner table: per vocabulary and chunk, each rank count's median tokens/s and peak
    memory, and the paired two-over-one-rank ratio."""
    from sonar.bench.common import readme_block

    cfg, m = doc["config"], doc["metrics"]
    ranks = cfg["ranks"]
    head = [f"{r} rank{'s' if r > 1 else ''}: tokens/s, peak{' per rank' if r > 1 else ''}" for r in ranks]
    two = 1 in ranks and 2 in ranks
    lines = ["| vocabulary | logits chunk | " + " | ".join(head) + (" | 2 over 1 rank" if two else "") + " |",
             "|---|---|" + "---|" * (len(ranks) + two)]
    for v in cfg["vocabs"]:
        for c in cfg["chunks"]:
            key = f"vocab={_label(v)}/chunk={c}"
            cells = [f"{m[f'{key}/ranks={r}/tokens_per_s']['median']:,.0f}, "
                     f"{m[f'{key}/ranks={r}/peak_mb']['median']:,.0f} MB" for r in ranks]
            if two:
                cells.append(f"{m[f'{key}/two_over_one_rank/tokens_per_s']['median']:.2f}×")
            lines.append(f"| {v:,} | {'none' if c == 0 else f'{c:,} tokens'} | " + " | ".join(cells) + " |")
    return readme_block("learner", json_name, lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1], int(argv[2]))
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts to run (default 1 2)")
    p.add_argument("--chunk", type=int, default=None, help="the chunked setting's learner.logits_chunk_tokens")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per trajectory")
    p.add_argument("--groups", type=int, default=None, help="groups of 4 trajectories per step")
    p.add_argument("--vocabs", type=int, nargs="+", default=None,
                   help=f"vocabulary sizes to run (default {TINY_VOCAB} {QWEN_VOCAB})")
    p.add_argument("--model", type=_model_spec, default=None, metavar="H,L,HEADS,I",
                   help="the policy's hidden size, layers, attention heads and MLP width (default: the tiny "
                        "policy's ModelConfig)")
    p.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help="learner.zero_stage of every setting (default 0)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the learner runs (auto: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per rank count, all settings")
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.repeats:
        cfg["repeats"] = args.repeats
    for k, v in (("ranks", args.ranks), ("seq_len", args.seq_len), ("groups", args.groups),
                 ("zero_stage", args.zero_stage), ("vocabs", args.vocabs)):
        if v is not None:
            cfg[k] = v
    if args.chunk is not None:
        cfg["chunks"] = [0, args.chunk]
    cfg["model"] = args.model or _model_spec(None)
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cfg.update(quick=args.quick, device=device, group_size=GROUP, micro_batch="all the step's tokens",
               peak="cuda max_memory_allocated delta" if device == "cuda" else "peak RSS delta (VmHWM reset per step)")
    t0 = time.time()
    metrics: dict = {}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="sonar-learner-bench-") as tmp:
        by_world = {w: run_ranks(cfg, w, device, Path(tmp), args.timeout_s) for w in cfg["ranks"]}
    collect(cfg, by_world, metrics, rows)
    extra = {"rows": rows, "wall_s": round(time.time() - t0, 1)}
    path = write_result(NAME, cfg, metrics, lambda png: plot(rows, png), args.out, extra=extra)
    for r in rows:
        print(f"[learner] V={_label(r['vocab']):>4} chunk={r['chunk']:>5} ranks={r['ranks']} "
              f"tokens={r['tokens']} step={min(r['step_s']):.3f}s peak={min(r['peak_mb']):.0f}MB "
              f"(unchunked logits {r['unchunked_logits_mb']:.0f}MB)")
    print(f"[learner] wrote {path} and {path.with_suffix('.png').name} in {extra['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
