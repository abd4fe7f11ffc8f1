"""The HTTP backend against a Search-R1-shaped ``/retrieve`` server this test starts on 127.0.0.1: the
request body, hit parsing (quoted titles, ids, scores, order), batching, error kinds, the retries and
the cache the factory stacks above it, and the bearer token."""
from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sonar.cluster.wire.config import HttpRetrievalConfig, RetrievalConfig
from sonar.retrieval.base import RetrievalError
from sonar.retrieval.http_backend import HTTPRetriever, parse_answer

DOCS = [{"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
        {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.\nSecond line.'},
        {"id": "2", "contents": "Rome\nRome is in Italy."}]


class SearchR1Server:
    """Answers as ``search_r1/search/retrieval_server.py`` does: for each query the documents whose text
    shares a word with it, scored by shared words. ``mode``: ok | 500 | 429 | 400 | garbage | no_result."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.mode = "ok"
        self.fail_next = 0
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
                if mode in ("500", "429", "400"):
                    self.send_response(int(mode))
                    self.end_headers()
                    return
                if mode == "garbage":
                    payload = b"<html>not json</html>"
                elif mode == "no_result":
                    payload = json.dumps({"answer": []}).encode()
                else:
                    payload = json.dumps({"result": [outer.answer(q, body["topk"], body["return_scores"])
                                                     for q in body["queries"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/retrieve"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def answer(q: str, k: int, scores: bool):
        words = set(q.lower().split())
        ranked = sorted(((len(words & set(d["contents"].lower().replace(".", " ").split())), d) for d in DOCS),
                        key=lambda x: -x[0])
        hits = [(s, d) for s, d in ranked if s > 0][:k]
        return [{"document": d, "score": float(s)} for s, d in hits] if scores else [d for _, d in hits]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = SearchR1Server()
    yield s
    s.close()


def test_the_request_is_search_r1s_and_hits_are_parsed_in_score_order(server):
    r = HTTPRetriever(server.url)
    (hits,) = r.batch_search(["capital of germany"], 2)
    assert server.bodies == [{"queries": ["capital of germany"], "topk": 2, "return_scores": True}]
    assert [(h.doc_id, h.title) for h in hits] == [("1", "Berlin"), ("0", "Paris")]
    assert hits[0].text == "Berlin is the capital of Germany.\nSecond line." and hits[0].score == 3.0
    assert r.name == f"http:{server.url}"


def test_a_large_call_is_split_into_requests_of_max_batch_in_order(server):
    r = HTTPRetriever(server.url, max_batch=2)
    out = r.batch_search(["paris", "rome", "berlin", "paris rome"], 1)
    assert [len(b["queries"]) for b in server.bodies] == [2, 2]
    assert [h[0].title for h in out] == ["Paris", "Rome", "Berlin", "Paris"]


@pytest.mark.parametrize("mode,kind", [("500", "http_5xx"), ("429", "http_429"), ("400", "bad_request"),
                                       ("garbage", "internal"), ("no_result", "internal")])
def test_failures_are_retrieval_error_kinds(server, mode, kind):
    server.mode = mode
    with pytest.raises(RetrievalError) as e:
        HTTPRetriever(server.url).batch_search(["paris"], 1)
    assert e.value.kind == kind


def test_a_closed_port_is_a_connection_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RetrievalError) as e:  # nothing listens there any more
        HTTPRetriever(f"http://127.0.0.1:{port}/retrieve", timeout_s=5).batch_search(["x"], 1)
    assert e.value.kind == "connection"


def test_answers_without_scores_or_with_title_text_records_parse():
    raw = json.dumps({"result": [[{"id": 7, "title": "T", "text": "body"}, {"contents": "only\nx"}]]}).encode()
    (hits,) = parse_answer(raw, 1, 5)
    assert [(h.doc_id, h.title, h.text) for h in hits][0] == ("7", "T", "body")
    assert hits[1].doc_id.startswith("sha1:") and hits[1].title == "only"
    with pytest.raises(RetrievalError, match=r"result\[0\]\[0\]: the document has neither 'contents' nor 'text'"):
        parse_answer(json.dumps({"result": [[{"document": {"id": 1}}]]}).encode(), 1, 1)
    with pytest.raises(RetrievalError, match="holds 1 hit lists for 2 queries"):
        parse_answer(json.dumps({"result": [[]]}).encode(), 2, 1)


def test_the_factory_retries_a_5xx_and_caches_above_the_server(server, tmp_path):
    from sonar.retrieval.factory import build_retriever

    cfg = dataclasses.replace(RetrievalConfig(), backend="http", http=HttpRetrievalConfig(url=server.url),
                              max_retries=2, backoff_s=0.0, cache_size=16)
    r = build_retriever(cfg, None, str(tmp_path))
    server.fail_next = 1  # the first attempt fails with a 500, the retry answers
    assert r.batch_search(["paris"], 1)[0][0].title == "Paris"
    assert len(server.bodies) == 2
    assert r.batch_search(["paris"], 1)[0][0].title == "Paris"  # the cache answers: no third request
    assert len(server.bodies) == 2
    assert not (tmp_path / "index").exists() and not any(tmp_path.iterdir())  # no local index for http


def test_the_token_comes_from_the_environment_as_a_bearer_header(server, monkeypatch):
    monkeypatch.setenv("MY_RETRIEVER_TOKEN", "s3cret")
    cfg = dataclasses.replace(RetrievalConfig(), http=HttpRetrievalConfig(url=server.url, token_env="MY_RETRIEVER_TOKEN"))
    r = HTTPRetriever.from_config(cfg)
    r.batch_search(["paris"], 1)
    assert server.headers[0]["Authorization"] == "Bearer s3cret"
    assert "s3cret" not in r.name and "s3cret" not in repr(r)  # the name keys caches and logs
