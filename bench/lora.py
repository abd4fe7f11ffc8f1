"""lora: what does LoRA (``learner.lora``, ``configs/lora.yaml``) change in a weight push and in what RL learns?

Question (issue 56): how long does one weight push take with LoRA against the whole model, and does the
default run keep its held-out EM when it trains adapters instead of the whole model?

- **Push.** The learner's ``send_weights`` to one receiver's ``recv_streamed`` (a second process, rank 1 of
  a gloo ``BroadcastGroup`` on loopback, its buckets loaded into preallocated parameters as a transformers
  engine's ``load_weights`` copies them), for a model of Qwen2.5-0.5B's shape in bf16 (the largest whose
  full push fits this machine twice over; its ``config.json`` values are written below): every parameter
  (what a full fine-tune pushes) against the rank-16 adapters of ``configs/lora.yaml`` (what a LoRA run
  pushes, ``with_lora`` on the meta-device model). The two alternate within each repeat; seconds are the
  sender's ``last_push["seconds"]`` (handshake to the last bucket's completion). The bytes of a Qwen2.5-7B
  push are computed from its shape, not timed (its full push does not fit this machine's memory twice).
- **EM.** ``sonar train`` on the default preset, one process per seed (``bench/default_run.py``), as is, and
  its RL again with ``--config lora`` from the SFT'd policy of that run (``measure_em`` says why), seeds 0
  and 1: held-out EM with search before and after RL, the bytes per weight push the run's summary prints,
  and the command's wall clock.

``--quick`` (CI smoke test): a 1M-parameter model for the push, 2 repeats, and the smoke preset cut short for
one seed of each run: it checks the plumbing and the JSON, not the numbers.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from sonar.bench.common import driver_bench_parser, summarise, write_result

NAME = "lora"
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
"""Qwen2.5-0.5B's ``config.json`` (the shape only; no weights are read)."""
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)
"""Qwen2.5-7B's ``config.json`` (RAG-R1's policy): the bytes of its pushes, computed."""
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True)
FULL = {"push_model": "qwen2.5-0.5b", "repeats": 7, "seeds": [0, 1], "config": "tiny", "overrides": []}
QUICK = {"push_model": "tiny", "repeats": 2, "seeds": [0], "config": "smoke",
         "overrides": ["stages.0.steps=2", "stages.1.steps=2", "stages.2.steps=1", "world.num_heldout_eval=8",
                       "rollout.num_workers=1", "eval.batch_size=8"]}
SHAPES = {"qwen2.5-0.5b": QWEN25_05B, "tiny": TINY}
log = logging.getLogger("sonar.bench")


def lora_settings() -> dict:
    """``configs/lora.yaml``'s adapters (``LoraConfig``'s fields)."""
    import dataclasses

    from sonar.cluster.wire.config import load_config

    return dataclasses.asdict(load_config(["lora"]).learner.lora)


def push_specs(shape: dict, lora: dict | None) -> list:
    """The ``TensorSpec``s a push of a model of ``shape`` moves in bf16: every parameter, or with ``lora`` the
    adapters peft adds (``with_lora`` on the meta-device model: the names, shapes and order a LoRA learner
    pushes)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from sonar.cluster.transport.weights import TensorSpec
    from sonar.cluster.wire.config import LoraConfig
    from sonar.cluster.wire.policy import with_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.bfloat16)
    if lora is not None:  # outside the meta context, as a vLLM worker wraps its meta model: peft then gives the
        model = with_lora(model, LoraConfig(**lora), seed=0)  # adapters the base's dtype (inside, float32)
    return [TensorSpec(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters() if p.requires_grad]


def _receiver(port: int, layouts: list, rounds: int, done) -> None:
    """Rank 1: join the group, then receive ``rounds`` pushes of each layout in turn, each bucket copied into
    parameters allocated once (a transformers engine's ``load_weights``)."""
    import torch

    from sonar.cluster.transport.weights import BroadcastGroup, plan_buckets

    torch.set_num_threads(1)
    group = BroadcastGroup("127.0.0.1", port, 1, 2, "gloo", prefix="lora-bench")
    plans = [plan_buckets(specs) for specs in layouts]
    params = [{s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs} for specs in layouts]

    def loader(into):
        def load(named):
            for n, t in named:
                into[n].copy_(t)
        return load

    for _ in range(rounds):
        for plan, into in zip(plans, params):
            group.recv_streamed(plan, loader(into))
    group.close()
    done.set()


def measure_push(shape: dict, lora: dict, repeats: int) -> dict:
    """Seconds per push (sender's view), full against adapters, alternating within each repeat."""
    import torch

    from sonar.cluster.transport.weights import BroadcastGroup, open_store, plan_buckets

    layouts = {"full": push_specs(shape, None), "lora": push_specs(shape, lora)}
    store = open_store("127.0.0.1", 2)
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Event()
    proc = ctx.Process(target=_receiver, args=(store.port, list(layouts.values()), repeats + 1, done), daemon=True)
    proc.start()
    try:
        group = BroadcastGroup("127.0.0.1", store.port, 0, 2, "gloo", prefix="lora-bench", store=store)
        g = torch.Generator().manual_seed(0)
        tensors = {k: {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in specs}
                   for k, specs in layouts.items()}
        plans = {k: plan_buckets(specs) for k, specs in layouts.items()}
        seconds: dict[str, list[float]] = {k: [] for k in layouts}
        for r in range(repeats + 1):  # the first round (buffers allocated, pages touched) is not counted
            for k in layouts:
                group.send_weights(plans[k], tensors[k])
                if r:
                    seconds[k].append(group.last_push["seconds"])
        done.wait(600)  # the receiver's last round ends with the sender's; then it closes its group
        group.close()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.terminate()
    nbytes = {k: sum(s.numel * s.dtype.itemsize for s in specs) for k, specs in layouts.items()}
    ratios = [f / a for f, a in zip(seconds["full"], seconds["lora"])]
    return {"bytes": nbytes, "tensors": {k: len(v) for k, v in layouts.items()}, "seconds": seconds,
            "ratio_full_over_lora": ratios}


def measure_em(bcfg: dict, base: Path) -> dict:
    """Per seed: the default run as is (``default_run``), then the same RL with ``--config lora`` from that run's
    SFT'd policy (its stage-0 checkpoint's export, the SFT stage given 0 steps), one process each. Why not
    LoRA from the start: LoRA adapts a pretrained model, and the embedded policy is randomly initialised, its
    embeddings and output head frozen under LoRA; trained so, the default run's SFT stage only took its loss
    from 5.3 to 4.6 in 250 of 300 steps (the whole model: to 0.07) and held-out EM stayed 0. A LoRA user starts
    from a pretrained or SFT'd model; this one starts RL from the SFT the whole model did."""
    from sonar.bench.default_run import command, run_seed

    out: dict[str, list] = {"full": [], "lora": []}
    for seed in bcfg["seeds"]:
        for variant in ("full", "lora"):
            root = base / f"{variant}-seed{seed}"
            extra, overrides = [], list(bcfg["overrides"])
            if variant == "lora":
                sft = next((base / f"full-seed{seed}").glob("*/checkpoints/stage0/hf"))
                extra, overrides = ["--config", "lora"], [*overrides, f"model.path={sft}", "stages.0.steps=0"]
            cmd = command(bcfg["config"], seed, root, overrides)
            at = cmd.index("--config") + 2
            cmd = cmd[:at] + extra + cmd[at:]  # the overlay right after the preset
            log.info("%s %s seed %d: %s", NAME, variant, seed, " ".join(cmd[1:]))
            rec = run_seed(cmd, root)
            summary = json.loads(next(root.glob("*/summary.json")).read_text())
            push_bytes = (summary.get("weights") or {}).get("push_bytes")
            out[variant].append({"seed": seed, "argv": ["sonar", *cmd[3:]], "push_bytes": push_bytes,
                                 **{k: rec[k] for k in ("em_before_search", "em_after_search", "f1_after_search",
                                                        "em_after_no_search", "trajectories_per_s",
                                                        "command_wall_s")}})
            log.info("%s %s seed %d: EM %s -> %s, %s B per push, %.0f s", NAME, variant, seed,
                     rec["em_before_search"], rec["em_after_search"], push_bytes, rec["command_wall_s"])
    return out


def run(bcfg: dict, run_root: str | None) -> tuple[dict, dict]:
    lora = lora_settings()
    t0 = time.monotonic()
    push = measure_push(SHAPES[bcfg["push_model"]], lora, bcfg["repeats"])
    log.info("%s push: full %.3f s, adapters %.4f s (median of %d)", NAME, statistics.median(push["seconds"]["full"]),
             statistics.median(push["seconds"]["lora"]), bcfg["repeats"])
    seven = {k: sum(s.numel * s.dtype.itemsize for s in push_specs(QWEN25_7B, v))
             for k, v in (("full", None), ("lora", lora))}
    keep = run_root is not None
    base = Path(run_root).resolve() if keep else Path(tempfile.mkdtemp(prefix="sonar-lora-bench-"))
    try:
        em = measure_em(bcfg, base)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    metrics = {
        "push_s": {k: summarise(v) for k, v in push["seconds"].items()},
        "push_ratio_full_over_lora": summarise(push["ratio_full_over_lora"]),
        "em_after_search": {k: summarise([r["em_after_search"] for r in rs]) for k, rs in em.items()},
        "em_before_search": {k: summarise([r["em_before_search"] for r in rs]) for k, rs in em.items()},
    }
    extra = {"lora": lora, "push": push, "push_model": bcfg["push_model"], "push_shape": SHAPES[bcfg["push_model"]],
             "qwen2.5_7b_push_bytes": seven, "em": em, "wall_s": round(time.monotonic() - t0, 1)}
    return metrics, extra


def plot(extra: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    p = extra["push"]
    ax[0].boxplot([p["seconds"]["full"], p["seconds"]["lora"]], tick_labels=[
        f"whole model\n{p['bytes']['full'] / 1e6:,.0f} MB", f"LoRA adapters\n{p['bytes']['lora'] / 1e6:,.1f} MB"])
    ax[0].set(title=f"one weight push, {extra['push_model']} bf16, gloo loopback (s)", yscale="log")
    em = extra["em"]
    for i, (k, rs) in enumerate(em.items()):
        ax[1].scatter([i] * len(rs), [100 * r["em_after_search"] for r in rs], label=k)
        ax[1].scatter([i] * len(rs), [100 * r["em_before_search"] for r in rs], marker="x", color="grey")
    ax[1].set_xticks(range(len(em)), [f"{k} fine-tune" if k == "full" else "LoRA" for k in em])
    ax[1].set(title="held-out EM with search: after RL (dots), before (x)", ylim=(0, 100), xlim=(-0.5, len(em) - 0.5))
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's LoRA block: the push both ways (this machine, and Qwen2.5-7B's bytes), then EM per
    seed of the default run's RL on the whole model and on LoRA from the same SFT'd policy."""
    x = doc["extra"]
    p, seven = x["push"], x["qwen2.5_7b_push_bytes"]
    ratio = doc["metrics"]["push_ratio_full_over_lora"]
    sec = doc["metrics"]["push_s"]
    lines = [f"<!-- lora table: bench/results/{json_name} (sonar bench lora; rendered by `sonar bench readme`) -->",
             f"One weight push, {x['push_model']} shape in bf16, gloo to a second process on this machine "
             f"(median [min, max] of {ratio['n']}); Qwen2.5-7B's bytes computed from its shape:", "",
             "| push | tensors | bytes | seconds | Qwen2.5-7B bytes |", "|---|---:|---:|---:|---:|"]
    for k, label in (("full", "whole model"), ("lora", f"LoRA adapters, rank {x['lora']['rank']}")):
        s = sec[k]
        lines.append(f"| {label} | {p['tensors'][k]} | {p['bytes'][k] / 1e6:,.1f} MB | {s['median']:.4f} "
                     f"[{s['min']:.4f}, {s['max']:.4f}] | {seven[k] / 1e9:,.2f} GB |")
    lines += ["", f"The whole model's push takes {ratio['median']:.1f}x [{ratio['min']:.1f}, {ratio['max']:.1f}] the "
              f"adapters' time (paired per repeat) for {p['bytes']['full'] / p['bytes']['lora']:.1f}x their bytes; a "
              f"7B's weights are {seven['full'] / seven['lora']:.0f}x its adapters' bytes.", "",
              "Held-out EM with search of the default run (`sonar train`), and of its RL on LoRA "
              "(`--config lora`) from the same SFT'd policy:", "",
              "| seed | before RL | after RL, whole model | after RL, LoRA | bytes per push, whole / LoRA |",
              "|---|---:|---:|---:|---:|"]
    for f, lo in zip(x["em"]["full"], x["em"]["lora"]):
        lines.append(f"| {f['seed']} | {_pct(f['em_before_search'])} | {_pct(f['em_after_search'])} | "
                     f"{_pct(lo['em_after_search'])} | {f['push_bytes']:,} / {lo['push_bytes']:,} |")
    lines.append("<!-- /lora table -->")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = driver_bench_parser(NAME, __doc__.splitlines()[0], "the preset of the EM runs")
    p.add_argument("--config", help="preset the EM runs train (default tiny; quick: smoke)")
    p.add_argument("--seeds", type=int, nargs="+", help="training seeds of each variant (default 0 1; quick: 0)")
    p.add_argument("--run-root", help="keep each run under DIR/<variant>-seed<S> (default: a temporary folder)")
    args = p.parse_args(argv)
    from sonar.bench.default_run import preset_path, run_settings

    bcfg = run_settings(args, QUICK, FULL)
    bcfg["quick"] = args.quick
    from sonar.bench.driver_harness import load_cfg
    from sonar.cluster.wire.config import to_dict

    # the configs as the commands load them (the LoRA run's model.path aside: the full run's SFT'd policy)
    preset = preset_path(bcfg["config"])
    resolved, sim = load_cfg([preset], bcfg["overrides"])
    resolved_lora, _ = load_cfg([preset, preset_path("lora")], [*bcfg["overrides"], "stages.0.steps=0"])
    bcfg.update(resolved=to_dict(resolved), resolved_lora=to_dict(resolved_lora), sim=sim.to_dict())
    metrics, extra = run(bcfg, args.run_root)
    path = write_result(NAME, bcfg, metrics, lambda png: plot(extra, png), args.out, extra=extra)
    print(f"[{NAME}] wrote {path}")
    m = metrics
    print(f"[{NAME}] push: whole model {m['push_s']['full']['median']:.3f} s, adapters "
          f"{m['push_s']['lora']['median']:.4f} s ({m['push_ratio_full_over_lora']['median']:.0f}x); EM after RL: "
          f"full {m['em_after_search']['full']['median']:.3f}, "
          f"LoRA {m['em_after_search']['lora']['median']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
