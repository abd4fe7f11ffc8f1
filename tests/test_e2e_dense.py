"""End to end (slow): a run that searches through the ``dense`` backend (issue 53). ``sonar index --dense``
encodes the world's corpus beside its BM25 index; the run's retrieval replicas open the vectors (never
encoding the corpus themselves), and every held-out search returns the corpus's documents by inner product."""
import json
from pathlib import Path

import pytest

from tests.sizing import smoke_sizing

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_a_run_searches_through_the_dense_backend(tmp_path, shared_ray, monkeypatch):
    from sonar.cluster.driver.indexing import run_index
    from sonar.cluster.driver.loop import train
    from sonar.cluster.wire.config import load_config
    from sonar.retrieval import rerank

    cfg = load_config([smoke_sizing(tmp_path)], [
        f"run.root={tmp_path}", f"run.run_dir={tmp_path / 'run'}", "world.num_heldout_eval=8",
        "tracking.log_model=false", "eval.before=false", "rollout.num_workers=1", "retrieval.backend=dense",
        "stages=[{name: sft, kind: sft, steps: 20, lr: 3.0e-3, batch_size: 32}, {name: rl, kind: rl, steps: 2, lr: 3.0e-4}]"])
    rep, vectors = run_index(cfg, progress=False)  # what `sonar index` does with backend=dense: --dense implied
    assert vectors is not None and len(vectors) == rep.num_docs
    real = rerank.build_passage_vectors

    def no_encoding(*a, **k):  # the driver's start-up must open the vectors, not build them
        raise AssertionError("a corpus-wide encode on the run's start-up path")
    monkeypatch.setattr(rerank, "build_passage_vectors", no_encoding)
    summary = train(cfg)
    monkeypatch.setattr(rerank, "build_passage_vectors", real)
    assert summary["replay"]["balanced"] and summary["learner_steps"] == 22
    (path,) = Path(summary["run_dir"]).glob("predictions-after_search.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [d for r in recs for sc in r["searches"] for q in sc["doc_ids"] for d in q]
    assert ids and all(sc["error"] is None for r in recs for sc in r["searches"])
    assert set(ids) <= set(vectors.row_of)  # the documents came from the dense index's corpus
