"""``sonar bench learner --quick``: runs the 1- and 2-rank DeepSpeed workers at vocabularies 200 and 151,936,
chunked and not, and writes a valid result; at 151,936 the chunked step's peak memory is well below the
unchunked one's (a memory figure, not a timing: the step holds 256 x 151,936 float32 logits unchunked)."""
from __future__ import annotations

import pytest

from sonar.bench import run
from tests.bench.test_bench_quick import load_result


@pytest.mark.slow
def test_learner_bench_quick(tmp_path):
    assert run.main(["learner", "--quick", "--out", str(tmp_path)]) == 0
    doc = load_result(tmp_path, "learner")
    m = doc["metrics"]
    for v in ("200", "152k"):
        for c in (0, 32):
            for r in (1, 2):
                assert m[f"vocab={v}/chunk={c}/ranks={r}/tokens_per_s"]["median"] > 0
                assert f"vocab={v}/chunk={c}/ranks={r}/peak_mb" in m
        assert f"vocab={v}/chunk=32/two_over_one_rank/tokens_per_s" in m
    # unchunked: 148 MiB of logits plus their gradient and softmax temporaries; chunked: 32 tokens' worth
    assert m["vocab=152k/ranks=1/unchunked_over_chunk32/peak_mb"]["median"] > 1.5
    assert {r["ranks"] for r in doc["extra"]["rows"]} == {1, 2}
    # the tiny policy's trunk by default, recorded; tied embeddings: the vocabularies differ by (V - 200) x hidden
    assert doc["config"]["model"] == {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 384}
    params = {r["vocab"]: r["params"] for r in doc["extra"]["rows"]}
    assert params[151_936] - params[200] == (151_936 - 200) * 128


def test_the_model_flag_sets_every_field_and_names_a_bad_value():
    import argparse

    from sonar.bench.learner_bench import _model_spec

    assert _model_spec("512,8,8,1408") == {"hidden_size": 512, "num_layers": 8, "num_heads": 8,
                                           "intermediate_size": 1408}
    for bad in ("512,8,8", "512,8,x,1408", "512,8,3,1408", "0,8,8,1408"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"--model '{bad}'"):
            _model_spec(bad)
