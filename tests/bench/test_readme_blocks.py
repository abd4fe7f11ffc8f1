"""Every results table of README.md and bench/README.md is its JSON's rendering (issue 24: the tables are
regenerated from the JSONs by a script, so they cannot drift).

A results block opens with ``<!-- KIND table: bench/results/X.json ... -->``; ``sonar bench readme``
(``bench/readme.py``) renders each from the result(s) it names. These tests (no Ray, no runs) keep every
block in both documents equal to that rendering and its JSON a full result from a clean tree, and pin each
renderer on a small constructed result against figures computed here.
"""
from __future__ import annotations

import json
import shutil

import pytest

from sonar.bench import (async_vs_sync, codec_and_queue, common, end_to_end, engines, learner_bench, multi_query,
                         readme, retrieval_bench, rollout_scaling, sensitivity, soak, weight_sync)

ROOT = common.REPO_ROOT
FOUND = [(doc, kind, names) for doc in common.READMES for kind, names in readme.blocks((ROOT / doc).read_text())]


def test_the_documents_have_their_blocks():
    kinds = {kind for _, kind, _ in FOUND}
    assert kinds == set(readme.BLOCKS), f"renderers without a block: {set(readme.BLOCKS) - kinds}; " \
                                        f"blocks without a renderer: {kinds - set(readme.BLOCKS)}"
    assert len(FOUND) >= 18  # 17 in bench/README.md (rollout-scaling twice), default-run's in README.md


@pytest.mark.parametrize("doc,kind,names", FOUND, ids=[f"{d}:{k}:{n[-1]}" for d, k, n in FOUND])
def test_a_block_is_the_rendering_of_its_json(doc, kind, names):
    text = (ROOT / doc).read_text()
    for n in names:
        path = ROOT / "bench" / "results" / n
        assert path.is_file(), f"{doc}'s {kind} table names bench/results/{n}, which is not there"
        assert "legacy" not in path.relative_to(ROOT / "bench" / "results").parts, \
            f"{doc}'s {kind} table shows a legacy result ({n}): bench/results/legacy/ is quoted only as legacy prose"
        common.validate_result(json.loads(path.read_text()))
    # load_full_result refuses a --quick run, a dirty tree, or another benchmark's result
    block = readme.render_block(kind, names)
    begin = f"<!-- {kind} table: " + ", ".join(f"bench/results/{n}" for n in names)
    assert common.splice(text, begin, f"<!-- /{kind} table -->", block, kind) == text, \
        f"{doc}'s {kind} table differs from {', '.join(names)}: `sonar bench readme` renders it"


def test_the_whole_documents_are_their_rendering():
    for doc in common.READMES:
        text = (ROOT / doc).read_text()
        assert readme.render_document(text) == text, f"{doc}: `sonar bench readme` would change it"


def test_markers_name_one_result_or_several():
    text = ("x\n<!-- learner table: bench/results/a.json (note) -->\n|t|\n<!-- /learner table -->\n"
            "<!-- async-vs-sync ablation table: bench/results/ablation/p/b.json, bench/results/c.json (n) -->\n"
            "<!-- /async-vs-sync ablation table -->\n<!-- default-run time -->")
    assert readme.blocks(text) == [("learner", ["a.json"]), ("async-vs-sync ablation", ["ablation/p/b.json", "c.json"])]


def S(median, lo=None, hi=None, n=None, **more):
    """A summary (``common.summarise``'s shape)."""
    lo, hi = median if lo is None else lo, median if hi is None else hi
    return {"median": median, "min": lo, "max": hi, "n": n or (1 if lo == hi else 3), **more}


def _result(name, config, metrics, extra, **more):
    return {"name": name, "config": {"quick": False, **config}, "hardware": {}, "versions": {}, "commit": "0123456789",
            "dirty": False, "allow_dirty": False, "timestamp": "2026-12-01T00:00:00+00:00", "argv": ["sonar"],
            "metrics": metrics, "extra": extra, **more}


def _rows(block: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines() if line.startswith("|")]


# ---------------------------------------------------------------------------------------- each renderer

def test_learner_table():
    m = {}
    for v in ("200", "152k"):
        for c in (0, 1024):
            for r in (1, 2):
                m[f"vocab={v}/chunk={c}/ranks={r}/tokens_per_s"] = S(1000.0 * r + c)
                m[f"vocab={v}/chunk={c}/ranks={r}/peak_mb"] = S(3211.8 / r)
            m[f"vocab={v}/chunk={c}/two_over_one_rank/tokens_per_s"] = S((2000.0 + c) / (1000.0 + c))
    doc = _result("learner", {"vocabs": [200, 151_936], "chunks": [0, 1024], "ranks": [1, 2]}, m, {})
    rows = _rows(learner_bench.render_table(doc, "l.json"))
    assert rows[0][2:] == ["1 rank: tokens/s, peak", "2 ranks: tokens/s, peak per rank", "2 over 1 rank"]
    assert rows[5] == ["151,936", "1,024 tokens", "2,024, 3,212 MB", "3,024, 1,606 MB", f"{3024 / 2024:.2f}×"]
    assert rows[2][:2] == ["200", "none"]


def test_sensitivity_table_takes_the_median_over_seeds():
    def row(sp, stale):
        return {"speedup": sp, "sync_wall_s": 60.0, "async_wall_s": 60.0 / sp, "sync_learner_share": 0.1,
                "async_stale_share": stale, "sync_trained_traj_per_s": 30.0, "async_trained_traj_per_s": 30.0 * sp}
    doc = _result("sensitivity", {}, {}, {"points": {"base": [row(1.8, 0.1), row(2.0, 0.2)],
                                                    "decode_sigma=1.2": [row(2.5, 0.0)]}})
    rows = _rows(sensitivity.render_table(doc, "s.json"))
    async_wall = (60 / 1.8 + 60 / 2.0) / 2
    assert rows[2] == ["`base`", "1.90×", f"60.0 → {async_wall:.1f} s", "30.0 → 57.0", "0.10", "15.0 %"]
    assert rows[3][:2] == ["`decode_sigma=1.2`", "2.50×"] and rows[3][-1] == "0.0 %"


def test_weight_sync_tables_say_skipped_and_compute_the_unpaired_ratios():
    variants = ["bucketed", "bucketed_reuse", "per_tensor"]
    m = {"memcpy/gbps": S(20.0)}
    table = []
    for n, skip in ((1, False), (2, True)):
        key = f"params=10M/workers={n}"
        for v, t in zip(variants, (0.04, 0.02, 0.05)):
            if v == "bucketed_reuse" and skip:
                continue
            m[f"{v}/{key}/seconds"] = S(t, t * 0.9, t * 1.5)
            m[f"{v}/{key}/gbps_per_receiver"] = S(0.04 / t)
            if v != "bucketed":
                m[f"ratio/bucketed_over_{v}/{key}/time"] = S(0.04 / t, 0.5, 3.0)
        m[f"ratio/bucketed_gbps_over_memcpy/{key}"] = S(0.05)
        row = {"label": "10M", "actual_params": 9_823_232, "bytes": 39_292_928, "tensors": 87, "buckets": 1,
               "workers": n, "bucketed_s": 0.04, "per_tensor_s": 0.05, "bucketed_calls": n + 1,
               "per_tensor_calls": n + 1}
        if not skip:
            row.update(bucketed_reuse_s=0.02, bucketed_reuse_gbps=2.0, bucketed_reuse_calls=2)
        table.append(row)
    doc = _result("weight-sync", {"variants": variants}, m, {"table": table})
    times = _rows(weight_sync.render_times_table(doc, "w.json"))
    assert times[2][:4] == ["10M (9.8M, 37 MiB)", "1", "87 / 1", "0.040 s [0.036–0.060], 1.00 GB/s, 2 calls"]
    assert times[3][4] == "skipped (memory)"
    ratios = _rows(weight_sync.render_ratios_table(doc, "w.json"))
    assert ratios[0][-2:] == ["per_tensor ÷ bucketed_reuse", "bucketed_reuse ÷ memcpy"]
    assert ratios[2] == ["10M", "1", "2.00 [0.50–3.00]", "0.80 [0.50–3.00]", "0.050", f"{0.05 / 0.02:.2f}",
                         f"{2.0 / 20.0:.3f}"]
    assert ratios[3][2] == "–" and ratios[3][-2:] == ["–", "–"]


def test_codec_and_queue_tables():
    m, queue = {}, []
    for tok, label in ((512, "512"), (8192, "8k")):
        m[f"codec/tokens={label}/encode_mb_per_s"] = S(118.7, 117.6, 120.0)
        m[f"codec/tokens={label}/decode_mb_per_s"] = S(1059.3, 1051.6, 1076.9)
        row = {"tokens": tok, "payload_bytes": 376_489, "items": 128, "batch": 16}
        for mode, _ in codec_and_queue.QUEUE_ROWS:
            m[f"queue/tokens={label}/{mode}/ms_per_item"] = S(1.5, 1.25, 2.0)
            m[f"queue/tokens={label}/{mode}/items_per_s"] = S(1000 / 1.5)
        for _, key in codec_and_queue.QUEUE_RATIOS:
            m[f"ratio/queue/tokens={label}/{key}"] = S(8.294)
        queue.append(row)
    codec = [{"tokens": 512, "message_bytes": 28_264, "bytes_per_token": 6.9004, "encode_ms": 0.238,
              "decode_ms": 0.2918},
             {"tokens": 8192, "message_bytes": 377_180, "bytes_per_token": 5.755, "encode_ms": 1.2946,
              "decode_ms": 1.2}]
    doc = _result("codec-and-queue", {"repeats": 5}, m, {"codec": codec, "queue": queue, "batch": 16})
    rows = _rows(codec_and_queue.render_codec_table(doc, "c.json"))
    assert rows[2] == ["512", "28 KB", "6.90", "119 [118–120]", "1059 [1052–1077]", "0.24", "0.29"]
    assert rows[3][1] == "377 KB"
    block = codec_and_queue.render_queue_table(doc, "c.json")
    rows = _rows(block)
    assert rows[0] == ["mode", "8 × 512 tokens (376 KB)", "8 × 8192 tokens (376 KB)"]
    assert rows[6] == ["`replay/get_batched` (`get(n_groups=16)`)"] + ["1.50 [1.25–2.00], 667/s"] * 2
    assert "median over 5 repeats" in block and "replay get one / batched 8.29 and 8.29" in block


def test_retrieval_table_shows_three_significant_figures():
    m = {}
    for stage, base in (("bm25", 848.2), ("dense", 55.16)):
        for i, kind in enumerate(("single", "batched", "multiquery")):
            m[f"{stage}/{kind}/nocache/qps"] = S(base * (1 + i), base * 0.9, base * (1 + i) * 1.01)
            m[f"{stage}/{kind}/cache/qps"] = S(base * 2.5 + 2000 * (stage == "bm25"))
            m[f"{stage}/{kind}/cache/hit_rate"] = S(0.6175)
    doc = _result("retrieval", {"rerank_n": 20, "batch": 64}, m, {})
    rows = _rows(retrieval_bench.render_table(doc, "r.json"))
    assert rows[0][2] == "batched (64 per call)"
    assert rows[2][1] == "848 [763, 857]"
    assert rows[3][1] == f"{848.2 * 2.5 + 2000:,.0f} (0.62)"
    assert rows[4][0].startswith("BM25 top-20 ") and rows[4][1:3] == ["55.2 [49.6, 55.7]", "110 [49.6, 111]"]
    assert rows[5][1] == "138"


def _ci(values):
    import statistics

    from sonar.bench.stats import mean_ci

    return {**mean_ci(values), "values": values, "mean": statistics.mean(values)}


def test_async_vs_sync_lags_table():
    def comp(sp, stale):
        pair = lambda s, a: {"sync": _ci(s), "async": _ci(a)}  # noqa: E731
        return {"speedup_rl_loop": _ci(sp), "speedup_with_startup": _ci([1.4, 1.5, 1.6]),
                "speedup_command": _ci([1.3, 1.4, 1.5]), "wall_s": pair([150, 149, 151], [100, 95, 98]),
                "trained_traj_per_s": pair([34, 34.5, 34.2], [52, 53, 54]),
                "generated_traj_per_s": pair([34, 34.5, 34.2], [55, 56, 57]),
                "generated_tokens_per_s": pair([730, 735, 736], [1190, 1200, 1210]),
                "stale_share": pair([0, 0, 0], stale),
                "generated_tokens_per_trained_traj": pair([21, 21.5, 21.6], [24, 24, 24]),
                "decode_row_steps_per_trained_traj": pair([70, 70, 70], [77, 77, 77]),
                "reward_last": pair([0.88, 0.89, 0.87], [0.9, 0.9, 0.9]),
                "heldout_em": pair([0.89, 0.9, 0.88], [0.9, 0.81, 0.88])}
    runs = lambda hists: [{"lag_hist": h} for h in hists]  # noqa: E731
    doc = _result("async-vs-sync", {"lags": [1, 2], "resolved": {"world": {"num_heldout_eval": 100}}}, {},
                  {"comparison": {"1": comp([1.5, 1.6, 1.5], [0.06, 0.06, 0.03]),
                                  "2": comp([2.0, 1.9, 2.0], [0.1] * 3)},
                   "settings": {"sync": runs([{"0": 640, "1": 0, "ge2": 0}] * 3),
                                "async_lag1": runs([{"0": 92, "1": 548, "2": 0}, {"0": 80, "1": 560, "2": 0}]),
                                "async_lag2": runs([{"0": 21, "1": 219, "2": 400}] * 2)}})
    rows = {r[0]: r[1:] for r in _rows(async_vs_sync.render_lags_table(doc, "a.json"))}
    assert rows[""] == ["sync", "async, lag 1", "async, lag 2"]
    sp = _ci([2.0, 1.9, 2.0])
    assert rows["**speedup, RL loop**"][2] == \
        f"**{sp['mean']:.2f} ± {sp['half']:.2f}×** ({sp['lo']:.2f}–{sp['hi']:.2f})"
    assert rows["**stale share** of generated trajectories"][0] == "0.0 ± 0.0 %"
    assert rows["**stale share** of generated trajectories"][2] == "**10.0 ± 0.0 %**"
    assert rows["tokens decoded per trained trajectory"] == ["21.4", "24.0 (1.12×)", "24.0 (1.12×)"]  # 24 / 21.37
    assert rows["decode row-steps per trained trajectory (simulated reasoning included)"] == ["1.00×"] + ["1.10×"] * 2
    assert rows["held-out EM after RL (100 questions)"][1].endswith("(0.90, 0.81, 0.88)")
    assert rows["policy lag of trained groups (0 / 1 / 2)"] == ["640 / 0 / 0", "~86 / ~554 / 0", "21 / 219 / 400"]


def test_async_vs_sync_ablation_table_reads_each_setting_from_its_config():
    def doc(cont, lanes, budget, tail, sp, n=1, live=True):
        m = {"speedup": {"2": S(sp, sp, sp, n)}, "sync/wall_s": S(90.0), "async_lag2/wall_s": S(90.0 / sp),
             "async_lag2/dropped_stale": S(96.0)}
        if live:
            m.update({"sync/engine_mean_live_rows": S(10.14), "async_lag2/engine_mean_live_rows": S(37.34)})
        return _result("async-vs-sync", {"lags": [2], "resolved": {
            "rollout": {"continuous_batching": cont, "batches_in_flight": lanes, "inject_decode_ms_per_token": tail},
            "replay": {"max_inflight_groups": budget}}}, m, {})
    block = async_vs_sync.render_ablation_table([("ablation/x-static/r.json", doc(False, 2, 0, 0.0, 1.8, live=False)),
                                                 ("r.json", doc(True, 8, -1, 10.0, 2.6, n=2))])
    rows = _rows(block)
    assert block.startswith("<!-- async-vs-sync ablation table: bench/results/ablation/x-static/r.json, "
                            "bench/results/r.json ")
    assert rows[2] == ["`x-static`", "static", "2", "none", "none", "1.80×", "90.0 → 50.0 s", "96", "–"]
    assert rows[3] == ["default", "continuous", "8", "(lag+1)·B", "yes", "2.60× (2 repeats)",
                       f"90.0 → {90 / 2.6:.1f} s", "96", "10.1 → 37.3"]


def test_multi_query_tables():
    m = {}
    for side, em in (("single", 0.305), ("multi", 0.19333)):
        m[f"{side}/all/em"] = S(em, mean=em, ci95=0.1952)
        for w in ("all", "parallel", "sequential"):
            for k in ("turns", "retrieval_calls", "queries", "gen_tokens"):
                m[f"{side}/{w}/{k}"] = S(1, mean=2.4649, ci95=0)
            m[f"{side}/{w}/wall_s"] = S(1, mean=0.05166, ci95=0)
            m[f"{side}/{w}/gpu_s"] = S(1, mean=0.20204, ci95=0)
    for clock in ("wall_s", "gpu_s"):
        for w in ("all", "natural", "parallel", "both_correct"):
            m[f"time_saving/{clock}/{w}"] = S(0.1, mean=0.27741, ci95=0.0762)
    m["oracle_time_saving/gpu_s/natural"] = S(0.08, mean=0.0801, ci95=0)
    doc = _result("multi-query", {}, m, {"questions": 200, "parallel_questions": 52, "natural_parallel_share": 0.2008})
    rows = _rows(multi_query.render_table(doc, "m.json"))
    assert rows[0] == ["per question", "single-query (`rag_r1`)", "multi-query (`rag_r1_multi`)"]
    assert rows[2] == ["held-out EM, all", "0.305 ± 0.195", "0.193 ± 0.195"]
    assert rows[3][1] == "2.46 / 2.46 / 2.46" and rows[7][1] == "51.7 / 51.7 ms" and rows[8][1] == "202 / 202 ms"
    rows = _rows(multi_query.render_saving_table(doc, "m.json"))
    assert rows[2] == ["all 200 questions (26 % parallel)", "27.7 % ± 7.6", "27.7 % ± 7.6", "–"]
    assert rows[3] == ["HotpotQA mix (20.1 % parallel)", "27.7 % ± 7.6", "27.7 % ± 7.6", "8.0 %"]


def test_rollout_scaling_tables_per_engine():
    m = {}
    for n, tps in ((1, 1.5865), (2, 2.6045)):
        w = f"workers={n}"
        m.update({f"{w}/trajectories_per_s": S(tps, tps - 0.02, tps + 0.1), f"{w}/searches_per_s": S(2 * tps),
                  f"{w}/efficiency_vs_linear": S(tps / n / 1.5865, 0.8, 0.85), f"{w}/overhead_ms_per_traj": S(0.81),
                  f"{w}/generated_tokens_per_s": S(240 * tps, 378, 380), f"{w}/engine_ms_per_traj": S(629.6),
                  f"{w}/model_time_fraction": S(0.99871)})
    rows = _rows(rollout_scaling.render_table(_result("rollout-scaling", {"engine": "vllm", "workers": [1, 2]}, m, {}),
                                              "v.json"))
    assert rows[2] == ["1", "1.59 [1.57–1.69]", "381 [378–380]", "1.00", "630", "99.9 %", "0.8 ms"]
    assert rows[3][3] == f"{2.6045 / 2 / 1.5865:.2f} [0.80–0.85]"
    m["workers=2/trajectories_per_s"] = S(29.17, 29.13, 29.22)
    rows = _rows(rollout_scaling.render_table(_result("rollout-scaling", {"engine": "bench", "workers": [1, 2]}, m, {}),
                                              "b.json"))
    assert rows[0] == ["workers", "traj/s", "searches/s", "efficiency vs linear", "Sonar overhead per trajectory"]
    assert rows[3][:2] == ["2", "29.2 [29.1–29.2]"] and rows[3][3] == f"{2.6045 / 2 / 1.5865:.2f}"


def test_end_to_end_table_adds_log_and_other_and_leaves_out_empty_parts():
    parts = {"wall_s": 0.30, "generate_sync_s": 0.0, "compute_s": 0.2, "queue_wait_s": 0.039, "health_s": 0.02,
             "rpc_s": 0.02, "broadcast_s": 0.006, "engine_load_s": 0.006, "log_s": 0.003, "other_s": 0.006}
    doc = _result("end-to-end", {}, {f"rl/critical/{k}": S(v) for k, v in parts.items()}, {})
    rows = _rows(end_to_end.render_table(doc, "e.json"))
    assert not any(r[0].startswith("generation in sync mode") for r in rows)
    assert rows[2] == ["learner compute (collate, forward, backward, optimizer)", "0.200", "67 %"]
    assert rows[-2] == ["logging, other", "0.009", "3 %"] and rows[-1] == ["**wall**", "**0.300**", "100 %"]


def test_engines_table_formats_per_model():
    m = {}
    for model, base in (("tiny", 1108.0), ("llama-50m", 46.48)):
        for n in (1, 8):
            for e in engines.ENGINES:
                m[f"tokens_per_s/{model}/{e}/rows={n}"] = S(base * n, base * n * 0.9, base * n * 1.1)
            m[f"ratio/{model}/vllm_over_hf/rows={n}"] = S(0.363)
    table = [{"model": "tiny", "params": 451_712}, {"model": "llama-50m", "params": 48_500_000}]
    doc = _result("engines", {"models": ["tiny", "llama-50m"], "engines": list(engines.ENGINES), "rows": [1, 8]}, m,
                  {"table": table})
    rows = _rows(engines.render_table(doc, "g.json"))
    assert rows[2] == ["tiny, 0.45M", "1", "1,108 (997–1,219)"] + ["1,108 (997–1,219)"] * 2 + ["0.36"]
    assert rows[3][0] == "tiny" and rows[4][:3] == ["llama, 48.5M", "1", "46.5 (41.8–51.1)"]


def test_soak_table():
    roles = {"driver": {"rss_mb_after_warmup": 798.37, "rss_mb_end": 800.28, "slope_mb_per_min": 0.445},
             "worker0": {"rss_mb_after_warmup": 1088.7, "rss_mb_end": 1099.6, "slope_mb_per_min": -0.047}}
    rows = _rows(soak.render_table(_result("soak", {}, {}, {"roles": roles}), "k.json"))
    assert rows[2:] == [["driver", "798 → 800 MB", "+0.4 MB/min"], ["worker 0", "1,089 → 1,100 MB", "0.0 MB/min"]]


# ------------------------------------------------------------------------------------- the command

def test_render_block_refuses_what_a_readme_may_not_show(tmp_path):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    roles = {"driver": {"rss_mb_after_warmup": 1.0, "rss_mb_end": 2.0, "slope_mb_per_min": 0.5}}
    for name, over in (("dirty.json", {"dirty": True}), ("quick.json", {"config": {"quick": True}}),
                       ("other.json", {"name": "engines"})):
        (results / name).write_text(json.dumps({**_result("soak", {}, {}, {"roles": roles}), **over}))
        with pytest.raises(ValueError, match="not a full soak result from a clean tree"):
            readme.render_block("soak", [name], tmp_path)
    with pytest.raises(ValueError, match="unknown kind"):
        readme.render_block("soak memory", ["dirty.json"], tmp_path)


def test_sonar_bench_readme_checks_and_rewrites_the_blocks(tmp_path, capsys):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    roles = {"driver": {"rss_mb_after_warmup": 798.4, "rss_mb_end": 800.3, "slope_mb_per_min": 0.46}}
    (tmp_path / "bench" / "results" / "s.json").write_text(json.dumps(_result("soak", {}, {}, {"roles": roles})))
    stale = "intro\n<!-- soak table: bench/results/s.json (old) -->\n| role | 1 |\n<!-- /soak table -->\nafter\n"
    for doc in common.READMES:  # every document the command reads; only bench/README.md has a block here
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / doc).write_text("no blocks\n")
    (tmp_path / "bench" / "README.md").write_text(stale)
    assert readme.main(["--check", "--root", str(tmp_path)]) == 1
    assert "bench/README.md: soak" in capsys.readouterr().err
    assert (tmp_path / "bench" / "README.md").read_text() == stale
    assert readme.main(["--root", str(tmp_path)]) == 0
    text = (tmp_path / "bench" / "README.md").read_text()
    assert text.startswith("intro\n<!-- soak table: bench/results/s.json (`sonar bench readme` writes this block;")
    assert "| driver | 798 → 800 MB | +0.5 MB/min |" in text and text.endswith("<!-- /soak table -->\nafter\n")
    assert readme.main(["--check", "--root", str(tmp_path)]) == 0


def test_the_committed_documents_pass_the_check(tmp_path):
    for doc in common.READMES:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, tmp_path / doc)
    shutil.copytree(ROOT / "bench" / "results", tmp_path / "bench" / "results",
                    ignore=shutil.ignore_patterns("*.png"))
    assert readme.main(["--check", "--root", str(tmp_path)]) == 0
