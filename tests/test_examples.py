"""examples/: every example is listed with the tests that run it, and the parts no end-to-end run covers
are checked here: the cluster example's commands name one config, which validates against a real model's
shapes on the GPUs it plans; the example search server ranks by BM25 (pinned to the closed form) and
speaks the wire Sonar's HTTP backend reads. The runs themselves: tests/test_e2e_files.py (own_data),
tests/test_e2e_tools.py (plugins, http_retriever), tests/cluster/test_job_submit.py (ray job submit)."""
from __future__ import annotations

import importlib.util
import math
import re
import shlex
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def test_every_example_is_listed_with_a_readme_and_the_tests_that_run_it():
    index = (EXAMPLES / "README.md").read_text()
    rows = re.findall(r"^\| \[`(\w+)/`\]\((\w+)/README.md\) \| .*? \| (.*?) \|$", index, re.M)
    assert rows, "examples/README.md lists no example"
    assert sorted(r[0] for r in rows) == sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    for folder, link, tests in rows:
        assert folder == link and (EXAMPLES / folder / "README.md").exists()
        named = re.findall(r"`(tests/[\w/]+\.py)`", tests)
        assert named and all((ROOT / t).exists() for t in named), (folder, tests)
    top = (ROOT / "README.md").read_text()
    assert "examples/README.md" in top or "(examples/)" in top  # the top-level README points here


def _bash_block(path: Path) -> list[list[str]]:
    block = re.search(r"```bash\n(.*?)```", path.read_text(), re.S).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_the_cluster_example_submits_the_config_it_validates_and_that_config_fits_its_gpus(capsys):
    from sonar.cluster.driver.cli import main

    lines = _bash_block(EXAMPLES / "cluster" / "README.md")
    validate = next(l for l in lines if l[:3] == ["sonar", "config", "validate"])[3:]
    submit = next(l for l in lines if l[:3] == ["ray", "job", "submit"])
    assert submit[submit.index("--") + 1:][:2] == ["sonar", "train"]
    assert submit[submit.index("--") + 3:] == validate  # the job runs what was validated
    ray_up = next(l for l in lines if l[:2] == ["ray", "up"])
    assert (ROOT / ray_up[2]).exists()
    shapes = ROOT / "tests" / "fixtures" / "model_shapes" / "qwen2.5-3b"  # the real config.json, no weights
    args = [f"model.path={shapes}" if a.startswith("model.path=") else a for a in validate]
    assert args != validate and main(["config", "validate", *args]) == 0
    out = capsys.readouterr().out
    assert "colocated GPU, one per learner rank (8)" in out and re.search(r"total \(peak: \w+\)\s+[\d.]+\s+of 80\.0 GiB: fits", out)


def _server_module():
    spec = importlib.util.spec_from_file_location("example_search_server", EXAMPLES / "http_retriever" / "server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DOCS = [{"id": "p", "title": "Paris", "text": "Paris is the capital of France."},
        {"id": "b", "title": "Berlin", "text": "Berlin is the capital of Germany."},
        {"id": "r", "title": "Rome", "text": "Rome is in Italy."}]


@pytest.fixture
def example_server():
    server_py = _server_module()
    httpd = server_py.make_server(DOCS, port=0)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/retrieve"
    httpd.shutdown()
    httpd.server_close()


def test_the_example_server_ranks_by_bm25_through_sonars_http_backend(example_server):
    from sonar.retrieval.http_backend import HTTPRetriever

    (hits,) = HTTPRetriever(example_server).batch_search(["capital france"], 3)
    assert [(h.doc_id, h.title) for h in hits] == [("p", "Paris"), ("b", "Berlin")]  # Rome shares no word
    # BM25 by hand (k1 1.2, b 0.75): N = 3 documents of 7, 7 and 5 words (title and text), "capital" in 2
    # of them, "france" in 1; each term occurs once in the documents that have it.
    avg = 19 / 3
    norm = 1.2 * (1 - 0.75 + 0.75 * 7 / avg)
    idf_capital, idf_france = math.log(1 + 1.5 / 2.5), math.log(1 + 2.5 / 1.5)
    assert hits[0].score == pytest.approx((idf_capital + idf_france) * 2.2 / (1 + norm), rel=1e-12)
    assert hits[1].score == pytest.approx(idf_capital * 2.2 / (1 + norm), rel=1e-12)
    assert hits[0].text == "Paris is the capital of France."  # title line and text split as Search-R1's client does


def test_the_example_server_refuses_a_corpus_line_without_its_fields(tmp_path):
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"id": "1", "title": "A", "text": "a"}\n\n{"id": "2", "text": "b"}\n')
    with pytest.raises(ValueError, match=r"corpus\.jsonl:3: the record has no \['title'\]"):
        _server_module().load_corpus(str(bad))
