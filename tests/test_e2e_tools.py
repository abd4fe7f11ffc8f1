"""End to end (slow): the visit tool through the real driver, with a reward plug-in and a field-mapped
dataset from outside the package. SFT demonstrations teach the visit call (search, then open the
search's first document in full, then answer); RL and the held-out evaluation then run it from the
policy's own calls, masked from the loss, with its accounting apart from the searches."""
import json

import pytest

from tests.sizing import smoke_sizing

from sonar.cluster.wire import metrics as K

pytestmark = [pytest.mark.slow, pytest.mark.ray]

PLUGINS = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "plugins" / "my_plugins.py"


@pytest.fixture(scope="module")
def visit_run(tmp_path_factory, shared_ray):
    from sonar.cluster.driver.loop import train
    from sonar.cluster.wire.config import load_config

    root = tmp_path_factory.mktemp("visit")
    cfg = load_config([smoke_sizing(root)], [
        f"run.root={root}", f"run.run_dir={root / 'visit'}", "world.num_heldout_eval=8", "tracking.log_model=false",
        "rollout.num_workers=1",
        "protocol.tools=[search,visit]", "protocol.visit_max_calls=1",
        "stages=[{name: sft, kind: sft, steps: 60, lr: 3.0e-3, batch_size: 32},"
        f" {{name: rl, kind: rl, steps: 2, lr: 3.0e-4, reward: {{name: '{PLUGINS}:short_answer_reward'}}}}]"])
    summary = train(cfg)
    rows = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    return cfg, summary, rows


def test_the_policy_visits_what_it_searched_and_visits_are_not_searches(visit_run):
    cfg, s, rows = visit_run
    assert s["learner_steps"] == 62 and s["replay"]["balanced"]
    from pathlib import Path

    (path,) = Path(s["run_dir"]).glob("predictions-after_search.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    visits = [c for r in recs for c in r["tool_calls"] if c["tool"] == "visit"]
    assert visits, "no held-out rollout visited a document after 60 SFT steps of demonstrations that do"
    shown = {d for r in recs for sc in r["searches"] for ids in sc["doc_ids"] for d in ids}
    assert any(c["refs"] and c["refs"][0] in shown for c in visits)  # it opened a document its search showed
    for r in recs:  # reward-neutral: the reward's search count is the searches alone
        assert r["reward_parts"]["num_searches"] == r["num_searches"]
        assert "<visit>" not in r["trace"] or r["tool_calls"]
    rl = [x for x in rows if x.get("stage") == 1 and K.LEARNER_VERSION in x]
    assert len(rl) == 2
    assert any(K.ROLLOUT_TOOL_CALLS_MEAN.format(tool="visit") in x for x in rows)
    # the reward plug-in scored the rollouts: its own part is logged beside Sonar's
    assert any(K.ROLLOUT_REWARD_PART.format(part="extra_searches") in x for x in rows)
    assert all(x.get(K.ROLLOUT_REWARD_PART.format(part="reward_error"), 0.0) == 0.0 for x in rows)
    saved = (Path(s["run_dir"]) / "config.yaml").read_text()
    assert "def short_answer_reward" in saved  # the run's config records the plug-in's code


def example_server():
    """examples/http_retriever/server.py, imported by its path as a user's file."""
    import importlib.util

    path = PLUGINS.parents[1] / "http_retriever" / "server.py"
    spec = importlib.util.spec_from_file_location("example_search_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def http_run(tmp_path_factory, shared_ray):
    """examples/http_retriever: its server (BM25 over the world's corpus, on 127.0.0.1 and a free port) and
    its config.yaml over the smoke preset, the URL pointed at that port."""
    import threading

    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import prepare_corpus
    from sonar.cluster.wire.config import load_config

    root = tmp_path_factory.mktemp("http")
    base = [f"run.root={root}", f"run.run_dir={root / 'http'}", "world.num_heldout_eval=8", "tracking.log_model=false",
            # SFT as long as the smoke preset's: its policy then searches at evaluation (after 6 steps it does not)
            "stages.0.steps=20", "stages.1.steps=2", "stages.2.steps=1", "eval.before=false", "rollout.num_workers=1"]
    local = load_config([smoke_sizing(root), "smoke"], base)
    server_py = example_server()
    bodies: list[dict] = []
    httpd = server_py.make_server(server_py.load_corpus(prepare_corpus(local, None)), port=0, on_request=bodies.append)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/retrieve"
        cfg = load_config(["smoke", PLUGINS.parents[1] / "http_retriever" / "config.yaml"],
                          [*base, f"retrieval.http.url={url}"])
        summary = train(cfg)
    finally:
        httpd.shutdown()
        httpd.server_close()
    return cfg, summary, bodies


def test_a_run_searches_through_a_search_r1_retrieval_server(http_run):
    cfg, s, bodies = http_run
    assert s["learner_steps"] == 23 and s["replay"]["balanced"] and cfg.retrieval.backend == "http"
    sent = [q for b in bodies for q in b["queries"]]
    assert sent and all(b["return_scores"] is True and b["topk"] == cfg.retrieval.k for b in bodies)
    assert all(1 <= len(b["queries"]) <= 4 for b in bodies)  # the example's retrieval.http.max_batch
    from pathlib import Path

    (path,) = Path(s["run_dir"]).glob("predictions-after_search.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [d for r in recs for sc in r["searches"] for q in sc["doc_ids"] for d in q]
    assert ids and all(sc["error"] is None for r in recs for sc in r["searches"])  # documents came back
    asked = {q for r in recs for sc in r["searches"] for q in sc["queries"]}
    assert asked and asked <= set(sent)  # each held-out search reached the server (a repeat: from the cache)
