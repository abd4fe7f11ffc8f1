"""``sonar bench engines --quick`` writes a valid result: tokens/s of every engine at every row count,
start-up times, and ratios against the static transformers engine (never the numbers themselves)."""
from __future__ import annotations

import json

import pytest

from sonar.bench import common, run


def _result(out) -> dict:
    (path,) = sorted(out.glob("engines-*.json"))
    doc = json.loads(path.read_text())
    common.validate_result(doc)
    assert path.with_suffix(".png").stat().st_size > 10_000
    return doc


def _check(doc: dict, engines: list[str]) -> None:
    m, cfg = doc["metrics"], doc["config"]
    assert cfg["quick"] is True and cfg["engines"] == engines and cfg["models"] == ["tiny"]
    for kind in engines:
        assert m[f"startup_s/tiny/{kind}"]["median"] > 0
        for rows in cfg["rows"]:
            assert m[f"tokens_per_s/tiny/{kind}/rows={rows}"]["median"] > 0
            if kind != "hf":
                assert m[f"ratio/tiny/{kind}_over_hf/rows={rows}"]["median"] > 0
    assert {(r["engine"], r["rows"]) for r in doc["extra"]["table"]} == {(k, r) for k in engines for r in cfg["rows"]}
    if "vllm" in engines:  # the weight push into vLLM's worker (checksum checked by the bench itself)
        assert m["push/tiny/gbps"]["median"] > 0 and m["push/tiny/total_s"]["median"] >= m["push/tiny/transfer_s"]["median"]


def test_engines_quick_transformers_only(tmp_path):
    assert run.main(["engines", "--quick", "--engines", "hf,hf-continuous", "--out", str(tmp_path)]) == 0
    _check(_result(tmp_path), ["hf", "hf-continuous"])


def test_unknown_engine_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run.main(["engines", "--quick", "--engines", "hf,tensorrt", "--out", str(tmp_path)])
    assert "tensorrt" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.vllm
def test_engines_quick_with_vllm(tmp_path):
    assert run.main(["engines", "--quick", "--out", str(tmp_path)]) == 0
    _check(_result(tmp_path), ["hf", "hf-continuous", "vllm"])
