"""The HTTP backend against a Search-R1-shaped ``/retrieve`` server this test starts on 127.0.0.1: the
request body, hit parsing (quoted titles, ids, scores, the server's order), batching, error kinds (the
blocking and the awaited path alike), the retries and the cache the factory stacks above it, the bearer
token, the config's checks, and the places that assume a local corpus (``sonar index``, data files).
The end-to-end run through the driver is ``tests/test_e2e_tools.py::test_a_run_searches_through_a_search_r1_retrieval_server``."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sonar.cluster.wire.config import HttpRetrievalConfig, RetrievalConfig, load_config
from sonar.retrieval.base import RetrievalError, native_async, search_async
from sonar.retrieval.http_backend import HTTPRetriever, parse_answer

DOCS = [{"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
        {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.\nSecond line.'},
        {"id": "2", "contents": "Rome\nRome is in Italy."}]

FAILURES = ("500", "503", "429", "408", "400", "422", "401", "403", "404", "405")


class SearchR1Server:
    """Answers as ``search_r1/search/retrieval_server.py`` does (``{"result": [[{"document", "score"}, ...],
    ...]}``, bare documents without ``return_scores``): for each query the documents that share a word
    with it, scored by the words shared, best first. ``answer`` may be replaced (the end-to-end run
    answers from a tantivy index). ``mode``: ok | an HTTP status in ``FAILURES`` | garbage (not JSON) |
    no_result (JSON without ``result``) | slow (answers once ``release`` is set); ``fail_next``: that many
    requests answer 500 first. ``bodies`` / ``headers``: what each request carried."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.mode = "ok"
        self.fail_next = 0
        self.release = threading.Event()
        self.waiting = threading.Event()  # a slow request has arrived and waits for ``release``
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                outer.headers.append(dict(self.headers))
                mode = outer.mode
                if outer.fail_next:
                    outer.fail_next -= 1
                    mode = "500"
                if mode == "slow":
                    outer.waiting.set()
                    outer.release.wait(30)  # the client's timeout is what the test looks at
                    mode = "ok"
                if mode in FAILURES:
                    self.send_response(int(mode))
                    self.end_headers()
                    return
                if mode == "garbage":
                    payload = b"<html>not json</html>"
                elif mode == "no_result":
                    payload = json.dumps({"detail": "Not Found"}).encode()
                else:
                    payload = json.dumps({"result": [outer.answer(q, body["topk"], body["return_scores"])
                                                     for q in body["queries"]]}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # a client that timed out has gone
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/retrieve"
        # shutdown() waits for serve_forever's next poll: 0.5 s by default, on every test's teardown
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    @staticmethod
    def answer(q: str, k: int, scores: bool):
        words = set(q.lower().split())
        ranked = sorted(((len(words & set(d["contents"].lower().replace(".", " ").replace('"', " ").split())), d)
                         for d in DOCS), key=lambda x: -x[0])
        hits = [(s, d) for s, d in ranked if s > 0][:k]
        return [{"document": d, "score": float(s)} for s, d in hits] if scores else [d for _, d in hits]

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = SearchR1Server()
    yield s
    s.close()


def search(r, queries, k, how):
    """``batch_search`` (blocking) or ``abatch_search`` (awaited in a fresh event loop)."""
    return r.batch_search(queries, k) if how == "sync" else asyncio.run(r.abatch_search(queries, k))


both = pytest.mark.parametrize("how", ["sync", "async"])


@both
def test_the_request_is_search_r1s_and_hits_are_parsed(server, how):
    r = HTTPRetriever(server.url)
    (hits,) = search(r, ["capital of germany"], 2, how)
    assert server.bodies == [{"queries": ["capital of germany"], "topk": 2, "return_scores": True}]
    assert server.headers[0]["Content-Type"] == "application/json"
    assert [(h.doc_id, h.title, h.score) for h in hits] == [("1", "Berlin", 3.0), ("0", "Paris", 2.0)]
    assert hits[0].text == "Berlin is the capital of Germany.\nSecond line."  # the title's line is not text
    assert r.name == f"http:{server.url}"


def test_the_awaited_search_is_native_not_a_thread():
    assert native_async(HTTPRetriever("http://127.0.0.1:1/retrieve")) is not None


@both
def test_the_servers_order_is_kept_and_k_bounds_each_list(server, how):
    # A FAISS index over L2 distance scores its best hit lowest; Search-R1's client keeps the server's order.
    server.answer = lambda q, k, scores: [{"document": d, "score": float(i)} for i, d in enumerate(DOCS)]
    (hits,) = search(HTTPRetriever(server.url), ["anything"], 2, how)
    assert [(h.doc_id, h.score) for h in hits] == [("0", 0.0), ("1", 1.0)]


@both
def test_without_scores_the_server_answers_bare_documents(server, how):
    r = HTTPRetriever.from_config(dataclasses.replace(
        RetrievalConfig(), http=HttpRetrievalConfig(url=server.url, return_scores=False)))
    (hits,) = search(r, ["paris"], 3, how)
    assert server.bodies[0]["return_scores"] is False
    assert [(h.doc_id, h.title, h.text, h.score) for h in hits] == [("0", "Paris", "Paris is the capital of France.", 0.0)]


@both
def test_a_large_call_is_split_into_requests_of_max_batch_in_order(server, how):
    r = HTTPRetriever(server.url, max_batch=2)
    out = search(r, ["paris", "rome", "berlin", "paris rome", "germany"], 1, how)
    assert [b["queries"] for b in server.bodies] == [["paris", "rome"], ["berlin", "paris rome"], ["germany"]]
    assert [h[0].title for h in out] == ["Paris", "Rome", "Berlin", "Paris", "Berlin"]
    assert search(r, [], 1, how) == [] and len(server.bodies) == 3  # nothing to ask: no request


KINDS = {"500": ("http_5xx", True), "503": ("http_5xx", True), "429": ("http_429", True), "408": ("timeout", True),
         "400": ("bad_request", False), "422": ("bad_request", False),
         # a wrong token or URL fails every search for the infrastructure, never for the query: not bad_request
         "401": ("connection", False), "403": ("connection", False), "404": ("connection", False),
         "405": ("connection", False),
         "garbage": ("internal", False), "no_result": ("internal", False)}


@both
@pytest.mark.parametrize("mode", list(KINDS))
def test_failures_are_retrieval_error_kinds(server, mode, how):
    server.mode = mode
    with pytest.raises(RetrievalError) as e:
        search(HTTPRetriever(server.url), ["paris"], 1, how)
    assert (e.value.kind, e.value.retryable) == KINDS[mode]
    if mode in ("401", "403"):
        assert "retrieval.http.token_env" in str(e.value)
    if mode in ("404", "405"):
        assert "retrieval.http.url" in str(e.value)
    if mode == "no_result":
        assert "no 'result' list" in str(e.value) and "detail" in str(e.value)


@both
def test_a_server_slower_than_timeout_s_is_a_timeout(server, how):
    server.mode = "slow"
    with pytest.raises(RetrievalError) as e:
        search(HTTPRetriever(server.url, timeout_s=0.3), ["paris"], 1, how)
    assert e.value.kind == "timeout" and e.value.retryable
    assert server.waiting.is_set()  # the request reached the server, which had not answered


@both
def test_a_closed_port_is_a_connection_error(how):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RetrievalError) as e:  # nothing listens there any more
        search(HTTPRetriever(f"http://127.0.0.1:{port}/retrieve", timeout_s=5), ["x"], 1, how)
    assert e.value.kind == "connection" and e.value.retryable


def test_answers_name_the_field_that_is_missing_or_wrong():
    raw = json.dumps({"result": [[{"id": 7, "title": "T", "text": "body"},
                                  {"title": "Berlin", "text": "x", "contents": '"Berlin"\nx'}]]}).encode()
    (hits,) = parse_answer(raw, 1, 5)
    assert (hits[0].doc_id, hits[0].title, hits[0].text) == ("7", "T", "body")
    # Search-R1's BM25 server returns stored documents without an id: the content names them, every call alike
    assert hits[1].doc_id.startswith("sha1:") and hits[1].title == "Berlin" and hits[1].text == "x"
    assert parse_answer(raw, 1, 5)[0][1].doc_id == hits[1].doc_id
    bad = {
        json.dumps({"result": [[{"document": {"id": 1}}]]}):
            r"result\[0\]\[0\]\.document: the document has neither 'contents' nor 'text'",
        json.dumps({"result": [[{"document": {"id": 1, "contents": 5}}]]}): r"result\[0\]\[0\]\.document\.contents",
        json.dumps({"result": [[{"document": DOCS[0], "score": "high"}]]}): r"result\[0\]\[0\]\.score: expected a number",
        json.dumps({"result": [[]]}): "holds 1 hit lists for 2 queries",
        json.dumps({"result": [{"a": 1}, []]}): r"result\[0\]: expected a list of hits",
        json.dumps([1, 2]): "no 'result' list",
        "not json": "not JSON",
    }
    for raw, message in bad.items():
        n = 2 if "[[]]" in raw or '{"a": 1}' in raw else 1
        with pytest.raises(RetrievalError, match=message) as e:
            parse_answer(raw.encode(), n, 1, "http://h/retrieve")
        assert e.value.kind == "internal" and "http://h/retrieve" in str(e.value)


def _http_cfg(url: str, **kw) -> RetrievalConfig:
    return dataclasses.replace(RetrievalConfig(), backend="http", http=HttpRetrievalConfig(url=url),
                               **{"max_retries": 2, "backoff_s": 0.0, "cache_size": 16, **kw})


@both
def test_the_factory_retries_a_5xx_and_caches_above_the_server(server, tmp_path, how):
    from sonar.retrieval.factory import build_retriever

    r = build_retriever(_http_cfg(server.url), None, str(tmp_path))
    server.fail_next = 1  # the first attempt fails with a 500, the retry answers

    def once():
        return r.batch_search(["paris"], 1) if how == "sync" else asyncio.run(search_async(r, ["paris"], 1))
    assert once()[0][0].title == "Paris"
    assert len(server.bodies) == 2
    assert once()[0][0].title == "Paris"  # the cache answers: no third request
    assert len(server.bodies) == 2
    assert not any(tmp_path.iterdir())  # no local index for http


def test_a_misconfigured_endpoint_is_not_retried_through_the_factory(server, tmp_path):
    from sonar.retrieval.factory import build_retriever

    server.mode = "404"
    with pytest.raises(RetrievalError) as e:
        build_retriever(_http_cfg(server.url), None, str(tmp_path)).batch_search(["paris"], 1)
    assert e.value.kind == "connection" and len(server.bodies) == 1


def test_dense_rerank_runs_above_the_http_backend_on_its_hits_alone(server, tmp_path):
    """The reranker encodes the candidates the server returned (their text), so it needs no local index."""
    from sonar.retrieval.factory import build_retriever

    r = build_retriever(_http_cfg(server.url, rerank="dense", rerank_candidates=2, cache_size=0), None, str(tmp_path))
    assert type(r).__name__ == "DenseReranker"
    (hits,) = r.batch_search(["paris"], 1)
    assert len(hits) == 1 and r.stats()["encoded"] >= 1 and server.bodies[0]["topk"] == 2
    assert not any(tmp_path.iterdir())  # still no local index


@both
def test_the_token_comes_from_the_environment_as_a_bearer_header(server, monkeypatch, how):
    monkeypatch.setenv("MY_RETRIEVER_TOKEN", "s3cret")
    cfg = dataclasses.replace(RetrievalConfig(), http=HttpRetrievalConfig(url=server.url, token_env="MY_RETRIEVER_TOKEN"))
    r = HTTPRetriever.from_config(cfg)
    search(r, ["paris"], 1, how)
    assert server.headers[0]["Authorization"] == "Bearer s3cret"
    shown = " ".join([r.name, repr(r), str(r), json.dumps(r.params())])  # the name keys caches and logs
    assert "s3cret" not in shown and "MY_RETRIEVER_TOKEN" in repr(r)
    assert "Authorization" not in HTTPRetriever(server.url)._headers  # no token_env: no header


def test_an_unset_token_variable_warns_by_name_and_sends_no_header(server, monkeypatch, caplog):
    monkeypatch.delenv("MY_RETRIEVER_TOKEN", raising=False)
    cfg = dataclasses.replace(RetrievalConfig(), http=HttpRetrievalConfig(url=server.url, token_env="MY_RETRIEVER_TOKEN"))
    with caplog.at_level(logging.WARNING, logger="sonar.retrieval.http_backend"):
        r = HTTPRetriever.from_config(cfg)
    assert "MY_RETRIEVER_TOKEN" in caplog.text
    r.batch_search(["paris"], 1)
    assert "Authorization" not in server.headers[0]


@pytest.mark.parametrize("overrides, message", [
    (["retrieval.http.url=ftp://127.0.0.1/retrieve"], "retrieval.http.url='ftp://127.0.0.1/retrieve' is not an http(s) URL"),
    (["retrieval.http.url=127.0.0.1:8000/retrieve"], "is not an http(s) URL with a host"),
    (["retrieval.http.url=http://user:hunter2@127.0.0.1:8000/retrieve"], "holds credentials"),
    (["retrieval.http.token_env=not a name"], "retrieval.http.token_env='not a name' is not an environment variable"),
    (["retrieval.http.max_batch=0"], "retrieval.http.max_batch"),
    (["retrieval.http.timeout_s=0"], "retrieval.http.timeout_s"),
])
def test_the_config_refuses_bad_http_settings_naming_the_field(overrides, message):
    with pytest.raises(ValueError) as e:
        load_config([], ["retrieval.backend=http", *overrides])
    assert message in str(e.value)
    assert "hunter2" not in str(e.value)


def test_the_config_takes_http_settings():
    cfg = load_config([], ["retrieval.backend=http", "retrieval.http.url=https://search.example:8443/retrieve",
                           "retrieval.http.max_batch=8", "retrieval.http.token_env=SEARCH_TOKEN",
                           "retrieval.http.return_scores=false"])
    assert cfg.retrieval.http == HttpRetrievalConfig("https://search.example:8443/retrieve", 10.0, 8, "SEARCH_TOKEN", False)
    assert RetrievalConfig().http.url == "http://127.0.0.1:8000/retrieve"  # where Search-R1's server listens


def test_the_retriever_refuses_credentials_in_its_url():
    with pytest.raises(ValueError, match="holds credentials") as e:
        HTTPRetriever("http://user:hunter2@127.0.0.1/retrieve")
    assert "hunter2" not in str(e.value)


def test_data_files_need_no_local_corpus_with_http_and_none_is_written(tmp_path):
    from sonar.cluster.driver.roles import prepare_corpus

    hotpot = str(Path(__file__).resolve().parents[2] / "examples" / "own_data" / "hotpot_mini.json")
    with pytest.raises(ValueError, match="retrieval.corpus=None"):
        load_config([], [f"stages.0.data={hotpot}", f"eval.data={hotpot}"])
    cfg = load_config([], [f"stages.0.data={hotpot}", f"eval.data={hotpot}", "retrieval.backend=http",
                           f"run.root={tmp_path}"])
    assert prepare_corpus(cfg, None) is None and not (tmp_path / "corpus").exists()


def test_sonar_index_refuses_http_naming_the_server(tmp_path, capsys):
    from sonar.cluster.driver.indexing import main

    cfg = load_config([], ["retrieval.backend=http", f"run.root={tmp_path}"])
    assert main(cfg, resume=False) == 2
    err = capsys.readouterr().err
    assert "retrieval.backend='http' has no index Sonar builds" in err and "127.0.0.1:8000/retrieve" in err
    assert not any(tmp_path.iterdir())
