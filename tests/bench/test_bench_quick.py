"""Smoke tests for the benchmarks: ``--quick`` runs and writes a valid result file and a PNG.

They check that each benchmark runs end to end and that its JSON follows the shared schema (resolved
config, hardware, versions, commit, timestamp, metrics as median/min/max summaries), never the numbers:
performance is reported as ratios measured inside one run, not as timed tests. The quick runs join the
session's local Ray cluster (``shared_ray``) and take about 45 s together on 2 cores, hence ``slow`` and
``ray``; the dispatcher and schema tests are fast.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sonar.bench import common, run

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_result(out: Path, name: str) -> dict:
    files = sorted(out.glob(f"{name}-*.json"))
    assert len(files) == 1, f"expected one {name} result in {out}, got {files}"
    doc = json.loads(files[0].read_text())
    common.validate_result(doc)  # required keys, every metric a {median,min,max,n} summary
    assert doc["name"] == name and doc["config"]["quick"] is True
    hw, ver = doc["hardware"], doc["versions"]
    assert hw["cpu_count"] >= 1 and hw["memory_gb"] > 0 and "gpu" in hw
    assert ver["python"] and ver["torch"] and ver["ray"]
    assert doc["commit"] and doc["timestamp"]
    assert files[0].name == f"{name}-{common._safe(hw['host'])}-{common._safe(doc['commit'])}.json"
    png = files[0].with_suffix(".png")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    return doc


# ------------------------------------------------------------------------------------ fast: no Ray
def test_summarise_and_schema_validation(tmp_path):
    assert common.summarise([3, 1, 2]) == {"median": 2, "min": 1, "max": 3, "n": 3}
    with pytest.raises(ValueError):
        common.summarise([])
    path = common.write_result("unit", {"a": 1}, {"x/seconds": common.summarise([0.1, 0.2])}, None, tmp_path)
    doc = json.loads(path.read_text())
    common.validate_result(doc)
    with pytest.raises(ValueError, match="not a summary"):
        common.validate_result({**doc, "metrics": {"x": 1.0}})
    with pytest.raises(ValueError, match="misses keys"):
        common.validate_result({k: v for k, v in doc.items() if k != "hardware"})


def test_validation_accepts_one_level_of_grouped_summaries(tmp_path):
    """``metrics.speedup`` (async-vs-sync) is ``{lag: summary}``; everything else stays flat."""
    speedup = {"1": common.summarise([1.4, 1.5, 1.6]), "2": common.summarise([1.9, 1.8, 2.0])}
    metrics = {"sync/wall_s": common.summarise([10.0, 11.0]), "speedup": speedup}
    path = common.write_result("unit", {"a": 1}, metrics, None, tmp_path)
    doc = json.loads(path.read_text())
    common.validate_result(doc)
    assert doc["metrics"]["speedup"]["2"]["median"] == pytest.approx(1.9)
    assert "speedup/2" not in doc["metrics"]

    def bad(value):
        return {**doc, "metrics": {**doc["metrics"], "speedup": value}}

    # a grouped value that is not a summary: the message names the sub-key
    with pytest.raises(ValueError, match=r"metrics\.speedup\.2.*not a summary"):
        common.validate_result(bad({**speedup, "2": 1.9}))
    with pytest.raises(ValueError, match=r"metrics\.speedup\.2.*not a summary"):
        common.validate_result(bad({**speedup, "2": {"median": 1.9, "min": 1.8}}))  # missing max, n
    # only one level: a group inside a group is not a summary either
    with pytest.raises(ValueError, match=r"metrics\.speedup\.2.*not a summary"):
        common.validate_result(bad({**speedup, "2": {"x": common.summarise([1.0])}}))
    # an empty group
    with pytest.raises(ValueError, match=r"metrics\.speedup.*empty group"):
        common.validate_result(bad({}))
    # min <= median <= max is checked inside a group too
    with pytest.raises(ValueError, match=r"metrics\.speedup\.1.*min <= median <= max"):
        common.validate_result(bad({**speedup, "1": {"median": 2.0, "min": 1.0, "max": 1.5, "n": 3}}))
    with pytest.raises(ValueError, match=r"metrics\.speedup\.1.*min <= median <= max"):
        common.validate_result(bad({**speedup, "1": {"median": 0.5, "min": 1.0, "max": 1.5, "n": 3}}))
    # a partial summary at the top level is still a broken summary, not a group
    with pytest.raises(ValueError, match=r"metrics\.sync/wall_s.*not a summary"):
        common.validate_result({**doc, "metrics": {"sync/wall_s": {"median": 1.0, "min": 1.0, "n": 1}}})
    # write_result validates before writing
    with pytest.raises(ValueError, match="empty group"):
        common.write_result("unit2", {}, {"speedup": {}}, None, tmp_path)


def test_dispatcher_rejects_unknown_and_unwritten_benchmarks(capsys):
    assert run.main(["no-such-bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no-such-bench'" in err and "weight-sync" in err and "codec-and-queue" in err
    for name in run.BENCHMARKS:
        if run.find_module(name) is None:  # a benchmark someone has not written yet
            assert run.main([name, "--quick"]) == 2
            assert "not written yet" in capsys.readouterr().err
    assert {"weight-sync", "codec-and-queue"} <= set(run.available())


@pytest.mark.slow
def test_sonar_cli_routes_bench():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "sonar", "bench", "--list"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "weight-sync" in r.stdout and "codec-and-queue" in r.stdout


def test_codec_quick_without_ray(tmp_path):
    assert run.main(["codec-and-queue", "--quick", "--skip-queue", "--out", str(tmp_path)]) == 0
    doc = load_result(tmp_path, "codec-and-queue")
    assert {"codec/tokens=512/encode_mb_per_s", "codec/tokens=2k/decode_mb_per_s"} <= set(doc["metrics"])


@pytest.mark.slow
def test_retrieval_quick(tmp_path):
    """``sonar bench retrieval --quick`` (no Ray; a noida-db server on 127.0.0.1 for the Elasticsearch part):
    every workload and the Elasticsearch protocol numbers are there. Its empty-index fixture once broke
    on the corpus reader's refusal of empty files and the result was written without them."""
    assert run.main(["retrieval", "--quick", "--out", str(tmp_path), "--work-dir", str(tmp_path / "work")]) == 0
    doc = load_result(tmp_path, "retrieval")
    m = doc["metrics"]
    for stage in ("bm25", "dense"):
        for kind in ("single", "batched", "multiquery"):
            for cache in ("cache", "nocache"):
                assert m[f"{stage}/{kind}/{cache}/qps"]["median"] > 0, (stage, kind, cache)
    assert doc["extra"]["notes"]["elasticsearch"].startswith("noida-db on http://127.0.0.1:")
    for n in (0, 100):
        for kind in ("single", "batched"):
            assert m[f"es/{n}docs/{kind}/qps"]["median"] > 0, (n, kind)
    assert "es/scan_ms_per_doc_per_query" in m and m["tantivy_fixture/100docs/single/qps"]["median"] > 0
    assert 0 < m["bm25/single/cache/hit_rate"]["median"] < 1  # the stream repeats queries, not all of them


@pytest.mark.slow
def test_schedule_sim_quick(tmp_path):
    """``sonar bench schedule-sim --quick`` (no Ray): validation, the 8-GPU comparison, the ablation at both
    batches and the projection for both workloads, and its README block renders from the JSON it wrote."""
    from sonar.bench import schedule_sim

    assert run.main(["schedule-sim", "--quick", "--jobs", "1", "--out", str(tmp_path)]) == 0
    doc = load_result(tmp_path, "schedule-sim")
    e = doc["extra"]
    assert set(e["compare"]) == set(e["ablation"]) == set(e["projection"]) == {"short", "long"}
    for ab in e["ablation"].values():
        assert set(ab["batches"]) == {"default", "_full"}
        for at in ab["batches"].values():
            assert {"pre-change", "production (all on)", "+ version-blocked claims wait"} <= set(at["variants"])
    block = schedule_sim.render_table(doc, "x.json")
    assert "Ablation at 8 GPUs" in block and "the default batch" in block and "the full batch" in block


# ------------------------------------------------------------------------------------ slow: real Ray
@pytest.fixture(scope="module")
def ray_local(shared_ray):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if shared_ray and not ray.is_initialized():  # the session's cluster (tests/conftest.py), as a job of its own
        ray.init(address=shared_ray, log_to_driver=True, configure_logging=False)
        started = True
    else:
        started = common.init_ray_local(num_cpus=4)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.ray
def test_weight_sync_quick(tmp_path, ray_local):
    assert run.main(["weight-sync", "--quick", "--out", str(tmp_path)]) == 0
    doc = load_result(tmp_path, "weight-sync")
    m = doc["metrics"]
    assert m["memcpy/gbps"]["median"] > 0 and m["first_touch/gbps"]["median"] > 0
    for n in doc["config"]["workers"]:
        for p in ("1M", "5M"):
            key = f"params={p}/workers={n}"
            for v in ("bucketed", "per_tensor", "per_tensor_ray", "ray_put"):
                assert m[f"{v}/{key}/seconds"]["median"] > 0
            assert m[f"bucketed/{key}/ray_calls"]["median"] == 1 + n  # one control call per rank
            tensors = m[f"per_tensor/{key}/collectives"]["median"]
            assert m[f"per_tensor_ray/{key}/ray_calls"]["median"] == (1 + n) * tensors  # one call per tensor per rank
            assert f"ratio/bucketed_over_per_tensor/{key}/time" in m
    assert not doc["extra"]["skipped"]


@pytest.mark.slow
@pytest.mark.ray
def test_codec_and_queue_quick(tmp_path, ray_local):
    assert run.main(["codec-and-queue", "--quick", "--out", str(tmp_path)]) == 0
    doc = load_result(tmp_path, "codec-and-queue")
    m = doc["metrics"]
    for mode in ("replay/put_one", "replay/put_inflight", "replay/get_one", "replay/get_batched",
                 "rayqueue/put_one", "rayqueue/put_batch", "rayqueue/get_one", "rayqueue/get_batch"):
        assert m[f"queue/tokens=512/{mode}/items_per_s"]["median"] > 0
    assert "ratio/queue/tokens=512/replay_get_one_over_batched" in m
