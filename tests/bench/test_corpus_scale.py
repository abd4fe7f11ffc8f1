"""``sonar bench corpus-scale``'s pure parts: the 21 M projection is the stated formulas applied to the
measured rates, the load generator sends every batch once, and the README block renders from a result."""
import threading

import pytest

from sonar.bench import corpus_scale as C


def result(passages=1000):
    serve = {"queries": 80, "rerank_queries": 16, "dense/bytes_per_s": 2e9, "dense/scan_s": 0.1,
             "dense/store_bytes": 1}
    for name in ("bm25", "rerank", "dense"):
        for c in (1, 4):
            serve[f"{name}/{c}"] = {"qps": {"bm25": 1000.0, "rerank": 0.5, "dense": 100.0}[name],
                                    "batch_ms_p50": 8.0, "batch_ms_p99": 9.0, "batches": 10}
    serve["rerank/1"].update(encoded_per_query=19.5, vector_hit_rate=0.02)
    serve["rerank/4"].update(encoded_per_query=19.0, vector_hit_rate=0.05)
    x = {"wall_s": 1.0, "peak_rss_mb": 100.0, "process_s": 1.2}
    return {"config": {"passages": passages, "clients": [1, 4], "batch": 8},
            "bm25": {**x, "docs": passages, "wall_s": 10.0, "index_bytes": 10 ** 6},
            "startup-none": {**x, "ready_s": 0.2, "first_batch_s": 0.1, "encoded": 0},
            "startup-dense": {**x, "ready_s": 3.0, "first_batch_s": 9.0, "encoded": 150},
            "minilm": {**x, "passages": 64, "seconds": 6.4, "passages_per_s": 10.0, "threads": 2, "mean_tokens": 200.0},
            "dense-kill": {"returncode": -9, "process_s": 5.0, "rows_done": 512, "status": "building", "shards": 4},
            "dense-resume": {**x, "encoded": 488, "vectors": 1000, "vector_bytes": 128_000},
            "serve": {**serve, **x}}


def test_the_projection_is_its_formulas():
    p = C.projection(result(), n=21_000_000)
    assert p["bm25_index_h_here"] == pytest.approx(21e6 / 100.0 / 3600)  # 1000 docs in 10 s
    assert p["bm25_index_bytes"] == pytest.approx(1e6 * 21_000)
    assert p["minilm_encode_days_here"] == pytest.approx(21e6 / 10.0 / 86400)
    per_gpu = 0.40 * 989e12 / (2 * 22.7e6 * 200.0)
    assert p["minilm_passages_per_s_h100"] == pytest.approx(per_gpu)
    assert p["minilm_encode_min_8xh100"] == pytest.approx(21e6 / (8 * per_gpu) / 60)
    assert p["minilm_store_bytes"] == 21_000_000 * 384 * 2
    assert p["dense_exact_batch_s_here"] == pytest.approx(21e6 * 768 / 2e9)
    assert p["dense_exact_batch_ms_h100"] == pytest.approx(1e3 * 21e6 * 768 / 3.35e12)
    assert p["rerank_ms_per_query_here"] == pytest.approx(2000.0)  # 0.5 queries/s at one client
    assert p["rerank_ms_per_query_h100"] == pytest.approx(1e3 * 20 / per_gpu)


def test_the_load_sends_every_batch_once_across_clients():
    seen, lock = [], threading.Lock()

    class Recorder:
        def batch_search(self, queries, k):
            with lock:
                seen.extend(queries)
            return [[] for _ in queries]

    qs = [f"q{i}" for i in range(37)]
    out = C.load(Recorder(), qs, clients=4, batch=8)
    assert sorted(seen) == sorted(qs) and out["batches"] == 5 and out["qps"] > 0


def test_the_readme_block_renders_from_a_result():
    doc = {"config": {"passages": 1000, "clients": [1, 4], "batch": 8}, "commit": "abc", "extra": result()}
    doc["extra"]["projection"] = C.projection(doc["extra"])
    text = C.render_table(doc, "corpus-scale-vm-abc.json")
    assert text.startswith("<!-- corpus-scale table: bench/results/corpus-scale-vm-abc.json")
    assert "| ... run again | 1 s | 100 MB | encoded 488 (the rest), 1,000 vectors |" in text
    assert "21,015,324 passages" in text
