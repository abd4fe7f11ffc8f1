"""ElasticRetriever against noida-db (or SONAR_ES_URL): mapping, bulk indexing, ranking, _msearch
order, secrets, error mapping, and the fault test (server killed mid-run and restarted).

Rankings are asserted, never scores: noida-db scores differently from Lucene.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
from urllib.parse import urlsplit

import pytest

from sonar.cluster.wire.config import ElasticConfig
from sonar.retrieval.base import Hit, RetrievalError
from sonar.retrieval.elastic import (
    SIMILARITY,
    VECTOR_FIELD,
    BulkIndexError,
    ElasticRetriever,
    bulk_index,
    create_index,
    index_body,
    map_exception,
)
from sonar.retrieval.resilient import ResilientRetriever
from tests.waiting import DEADLINE_S, wait_until

EXTERNAL = bool(os.environ.get("SONAR_ES_URL"))

# 50 made-up entities; doc i mentions entity i+1 in its text, so a query for a name matches two docs
# and the title boost must put the entity's own passage first.
NAMES = [
    "zorvath", "quellin", "braxmor", "tildane", "oskeru", "vandrel", "pimmoth", "achlyra", "dunsk", "feyrow",
    "glimmek", "hostavar", "iskelde", "jorrun", "kelvash", "lumbrisk", "morvane", "nethrel", "ostrag", "pellund",
    "quarrow", "rendish", "sylthar", "tormek", "ulvadi", "vexholm", "wendrake", "xanthor", "yarrowin", "zebulast",
    "ambrith", "belquor", "cindrath", "delvonn", "eskaroth", "fallowin", "gorvash", "harnquist", "ilvermoor",
    "jexalon", "kryndle", "lorvath", "mistrane", "norquil", "orbesk", "pravelin", "quistrom", "ravensk", "solvaine",
    "trembluk",
]
KINDS = ["city", "company", "person", "river", "mountain"]
DOCS = [
    {"id": f"d{i:02d}", "title": name.capitalize(),
     "text": f"{name.capitalize()} is a {KINDS[i % 5]} famous for its {NAMES[(i * 7 + 3) % 50]}ian exports. "
             f"Travellers often compare it with {NAMES[(i + 1) % 50].capitalize()}."}
    for i, name in enumerate(NAMES)
]


def _retriever(cfg: ElasticConfig, **kw) -> ElasticRetriever:
    scheme = urlsplit(cfg.hosts[0]).scheme
    extra = {}
    if scheme == "https" and EXTERNAL and "127.0.0.1" in cfg.hosts[0]:
        extra["ssl_assert_hostname"] = urlsplit(os.environ["SONAR_ES_URL"]).hostname  # through the proxy
    extra.update(kw)
    return ElasticRetriever.from_config(cfg, **extra)


@pytest.fixture(scope="module")
def indexed(es_url, make_es_config):
    """(retriever, create body) for a fresh index holding DOCS, built with k1=0.9, b=0.4."""
    cfg = make_es_config(es_url, bm25_k1=0.9, bm25_b=0.4, title_boost=3.0)
    r = _retriever(cfg)
    body = r.create_index()
    n = bulk_index(r.client, r.index, DOCS, batch_size=16, progress=False)
    assert n == len(DOCS)
    yield r, body
    r.close()


# ------------------------------------------------------------------------------------ no server
def _meta(status):
    from elastic_transport import ApiResponseMeta, HttpHeaders, NodeConfig

    return ApiResponseMeta(status=status, http_version="1.1", headers=HttpHeaders(), duration=0.0,
                           node=NodeConfig("http", "127.0.0.1", 9200))


@pytest.mark.parametrize("status,kind,retryable", [
    (429, "http_429", True), (500, "http_5xx", True), (503, "http_5xx", True), (400, "bad_request", False),
    (404, "bad_request", False), (401, "bad_request", False), (408, "timeout", True)])
def test_api_errors_map_to_kinds(status, kind, retryable):
    from elasticsearch import ApiError

    err = map_exception(ApiError("some_exception", meta=_meta(status), body={}))
    assert err.kind == kind and err.retryable is retryable
    assert str(status) in str(err)


def test_transport_errors_map_to_kinds():
    from elasticsearch import ConnectionError, ConnectionTimeout, SSLError

    assert map_exception(ConnectionTimeout("read timed out")).kind == "timeout"
    assert map_exception(ConnectionError("refused")).kind == "connection"
    ssl = map_exception(SSLError("bad cert"))
    assert ssl.kind == "connection" and not ssl.retryable
    assert map_exception(ValueError("x")).kind == "internal"


class FakeClient:
    """Records _msearch bodies; answers with canned per-search responses."""

    def __init__(self, responses=None, exc=None):
        self.bodies = []
        self.responses = responses
        self.exc = exc

    def msearch(self, searches):
        self.bodies.append(searches)
        if self.exc:
            raise self.exc
        if self.responses is not None:
            return {"responses": self.responses}
        out = []
        for search in searches[1::2]:
            q = search["query"]["multi_match"]["query"]
            out.append({"status": 200, "hits": {"hits": [
                {"_id": q, "_score": 1.0, "_source": {"id": q, "title": q, "text": q}}]}})
        return {"responses": out}


def test_one_msearch_per_batch_in_input_order_and_empty_queries_not_sent():
    fc = FakeClient()
    r = ElasticRetriever(fc, "idx", title_boost=2.0, hosts=["http://127.0.0.1:9"])
    out = r.batch_search(["b", "", "a", "   ", "c"], 3)
    assert [[h.doc_id for h in hits] for hits in out] == [["b"], [], ["a"], [], ["c"]]
    assert len(fc.bodies) == 1
    body = fc.bodies[0]
    assert body[0] == {"index": "idx"} and len(body) == 6
    mm = body[1]["query"]["multi_match"]
    assert mm == {"query": "b", "fields": ["title^2", "text"], "type": "best_fields"} and body[1]["size"] == 3
    assert r.batch_search(["", " "], 3) == [[], []] and len(fc.bodies) == 1  # nothing to send
    assert r.stats()["requests"] == 1 and r.stats()["queries"] == 3


def test_query_text_is_never_parsed_as_syntax():
    fc = FakeClient()
    r = ElasticRetriever(fc, "idx", title_boost=1.5, hosts=[])
    nasty = 'title:"x" AND (y OR z)\x00\x07 ~ * ? \\ / {"script": 1}'
    r.batch_search([nasty], 1)
    sent = fc.bodies[0][1]
    assert "query_string" not in json.dumps(sent) and "simple_query_string" not in json.dumps(sent)
    q = sent["query"]["multi_match"]["query"]
    assert "\x00" not in q and "\x07" not in q and 'title:"x" AND (y OR z)' in q
    assert sent["query"]["multi_match"]["fields"] == ["title^1.5", "text"]


def test_per_query_error_returns_empty_for_that_query_only():
    ok = {"status": 200, "hits": {"hits": [{"_id": "x", "_score": 2.0, "_source": {"id": "x", "title": "X", "text": "t"}}]}}
    bad = {"status": 400, "error": {"type": "parsing_exception", "reason": "nope"}}
    r = ElasticRetriever(FakeClient([ok, bad, ok]), "idx", hosts=[])
    out = r.batch_search(["a", "b", "c"], 1)
    assert [len(h) for h in out] == [1, 0, 1] and out[0][0] == Hit("x", "X", "t", 2.0)
    assert r.stats()["query_errors"] == {"bad_request": 1} and r.stats()["errors"] == {}


def test_all_queries_failing_raises_for_the_batch():
    busy = {"status": 429, "error": {"type": "es_rejected_execution_exception", "reason": "queue full"}}
    r = ElasticRetriever(FakeClient([busy, busy]), "idx", hosts=[])
    with pytest.raises(RetrievalError) as ei:
        r.batch_search(["a", "b"], 1)
    assert ei.value.kind == "http_429" and ei.value.retryable
    assert r.stats()["errors"] == {"http_429": 1}


def test_client_exceptions_become_retrieval_errors():
    from elasticsearch import ConnectionError

    r = ElasticRetriever(FakeClient(exc=ConnectionError("refused")), "idx", hosts=[])
    with pytest.raises(RetrievalError) as ei:
        r.batch_search(["a"], 1)
    assert ei.value.kind == "connection"
    assert r.stats()["errors"] == {"connection": 1}


def test_index_body_is_explicit():
    body = index_body(k1=0.9, b=0.4, store_vectors=True, dims=384)
    assert body["settings"]["index"]["similarity"][SIMILARITY] == {"type": "BM25", "k1": 0.9, "b": 0.4}
    props = body["mappings"]["properties"]
    assert props["id"] == {"type": "keyword"}
    assert props["title"]["similarity"] == SIMILARITY and props["text"]["similarity"] == SIMILARITY
    assert props[VECTOR_FIELD] == {"type": "dense_vector", "dims": 384, "index": True, "similarity": "cosine"}
    assert VECTOR_FIELD not in index_body()["mappings"]["properties"]
    with pytest.raises(ValueError):
        index_body(b=1.5)


SECRET_KEY = "sk-TOP-SECRET-apikey-0123456789"
SECRET_PW = "hunter2-TOP-SECRET-pw"


def test_from_config_reads_secrets_from_named_env_vars_only(monkeypatch):
    monkeypatch.setenv("MY_TEST_ES_KEY", SECRET_KEY)
    bad = ElasticConfig(hosts=["http://127.0.0.1:9", "https://alice:pw-in-url@es.example:9243"], index="i")
    with pytest.raises(ValueError, match="credentials") as ei:
        ElasticRetriever.from_config(bad)
    # The host is named with its userinfo redacted (cluster.wire.redact), the password never.
    assert "pw-in-url" not in str(ei.value) and "alice" not in str(ei.value)
    assert "https://***@es.example:9243" in str(ei.value)
    cfg = ElasticConfig(hosts=["http://127.0.0.1:9", "https://es.example:9243"], index="i",
                        api_key_env="MY_TEST_ES_KEY", request_timeout_s=3.5, verify_certs=False)
    r = ElasticRetriever.from_config(cfg)
    node = r.client.transport.node_pool.all()[0].config
    assert r.client._headers.get("authorization") == f"ApiKey {SECRET_KEY}"  # the key did reach the client
    assert r.client._request_timeout == 3.5 and r.client._max_retries == 0 and node.verify_certs is False
    shown = [repr(r), str(r), json.dumps(r.params()), repr(cfg), r.name]
    for text in shown:
        assert SECRET_KEY not in text
    assert r.params()["auth"] == "api_key(env:MY_TEST_ES_KEY)"
    assert "https://es.example:9243" in r.params()["hosts"]
    r.close()

    monkeypatch.delenv("MY_TEST_ES_KEY")
    r2 = ElasticRetriever.from_config(cfg, env={"SONAR_ES_USERNAME": "bob", "SONAR_ES_PASSWORD": SECRET_PW})
    assert r2.auth == "basic(env:SONAR_ES_USERNAME,SONAR_ES_PASSWORD)"
    assert r2.client._headers.get("authorization", "").startswith("Basic ")
    assert SECRET_PW not in repr(r2) and SECRET_PW not in json.dumps(r2.params())
    r2.close()
    r3 = ElasticRetriever.from_config(cfg, env={})
    assert r3.auth == "none" and r3.client._headers.get("authorization") is None
    r3.close()
    direct = ElasticRetriever(object(), "i", hosts=["https://alice:pw-in-url@es.example:9243"])
    assert "pw-in-url" not in repr(direct) and "pw-in-url" not in direct.name


# ------------------------------------------------------------------------------------ with a server

@pytest.mark.es
def index_similarity(client, index: str) -> dict[str, float]:
    """The k1/b the server reports for ``index`` (GET _settings), e.g. {'k1': 1.2, 'b': 0.75}."""
    settings = client.indices.get_settings(index=index)
    sim = next(iter(settings.values()))["settings"]["index"]["similarity"][SIMILARITY]
    return {"k1": float(sim["k1"]), "b": float(sim["b"])}


def test_mapping_and_similarity_are_what_we_configured(indexed):
    r, body = indexed
    assert body["settings"]["index"]["similarity"][SIMILARITY] == {"type": "BM25", "k1": 0.9, "b": 0.4}
    assert index_similarity(r.client, r.index) == {"k1": 0.9, "b": 0.4}  # GET _settings
    props = next(iter(r.client.indices.get_mapping(index=r.index).values()))["mappings"]["properties"]
    assert props["id"]["type"] == "keyword"
    assert props["title"]["type"] == "text" and props["title"]["similarity"] == SIMILARITY
    assert props["text"]["similarity"] == SIMILARITY
    with pytest.raises(ValueError, match="already exists"):
        r.create_index()
    assert r.client.count(index=r.index)["count"] == len(DOCS)


@pytest.mark.es
@pytest.mark.parametrize("i", [0, 7, 13, 26, 49])
def test_clear_queries_rank_the_right_doc_first(indexed, i):
    r, _ = indexed
    hits = r.batch_search([NAMES[i]], 5)[0]
    assert hits[0].doc_id == DOCS[i]["id"]
    assert hits[0].title == DOCS[i]["title"] and hits[0].text == DOCS[i]["text"]
    # The previous doc mentions this name in its text only: it matches, below (title boost).
    assert DOCS[(i - 1) % 50]["id"] in [h.doc_id for h in hits[1:]]
    assert all(a.score >= b.score for a, b in zip(hits, hits[1:]))


@pytest.mark.es
def test_msearch_results_follow_input_order(indexed):
    r, _ = indexed
    order = [31, 4, 17, 0, 48, 22, 9, 40, 12, 3]
    before = r.stats()["requests"]
    out = r.batch_search([f"{NAMES[i]} {KINDS[i % 5]}" for i in order], 3)
    assert r.stats()["requests"] == before + 1  # one _msearch for the whole batch
    assert [hits[0].doc_id for hits in out] == [DOCS[i]["id"] for i in order]
    assert all(len(hits) <= 3 for hits in out)


@pytest.mark.es
def test_unknown_words_special_characters_and_empty_queries(indexed):
    r, _ = indexed
    out = r.batch_search(["qqqqxxxx", 'zorvath" AND (OR title:* \\', "", NAMES[5]], 2)
    assert out[0] == [] and out[2] == []
    assert out[1][0].doc_id == "d00" and out[3][0].doc_id == "d05"


@pytest.mark.es
def test_async_client_matches_sync(indexed, es_url):
    r, _ = indexed
    cfg = ElasticConfig(hosts=[es_url], index=r.index)
    ar = _retriever(cfg)

    async def main():
        try:
            return await ar.abatch_search([NAMES[3], NAMES[30]], 2)
        finally:
            await ar.aclose()

    out = asyncio.run(main())
    assert [h[0].doc_id for h in out] == ["d03", "d30"]
    assert [[h.doc_id for h in x] for x in out] == [[h.doc_id for h in x] for x in r.batch_search([NAMES[3], NAMES[30]], 2)]
    ar.close()


@pytest.mark.es
def test_bulk_index_progress_and_failures_name_the_doc(es_url, make_es_config):
    cfg = make_es_config(es_url, store_vectors=True)
    r = _retriever(cfg)
    create_index(r.client, r.index, 1.2, 0.75, store_vectors=True, dims=4)
    docs = DOCS[:6]
    vectors = [[1.0, 0.0, 0.0, 0.0]] * 6
    vectors[4] = [1.0, 2.0]  # wrong dims: the server rejects d04
    buf = io.StringIO()  # the tqdm bar writes to stderr
    with contextlib.redirect_stderr(buf), pytest.raises(BulkIndexError) as ei:
        bulk_index(r.client, r.index, docs, batch_size=2, progress=True, vectors=vectors)
    assert [doc_id for doc_id, _ in ei.value.failures] == ["d04"]
    assert "d04" in str(ei.value) and ei.value.indexed == 5
    assert "6/6" in buf.getvalue()  # the progress bar ran to the end
    assert r.client.count(index=r.index)["count"] == 5  # refreshed at the end
    with pytest.raises(ValueError, match="no 'id'"):
        bulk_index(r.client, r.index, [{"title": "t", "text": "x"}], progress=False)
    with pytest.raises(ValueError, match="vector"):
        bulk_index(r.client, r.index, DOCS[:2], progress=False, vectors=[[1.0, 0, 0, 0]])
    r.close()


@pytest.mark.es
def test_server_side_dense_rerank(es_url, make_es_config):
    """BM25 candidates reranked by cosine to the query vector (rescore + script_score)."""
    cfg = make_es_config(es_url, store_vectors=True)
    r = _retriever(cfg)
    r.dims = 4
    r.create_index()
    docs = [{"id": "a", "title": "owl", "text": "the owl hunts at night"},
            {"id": "b", "title": "owl facts", "text": "owl owl owl: an owl is a bird"},
            {"id": "c", "title": "river", "text": "a river with no birds"}]
    vecs = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    bulk_index(r.client, r.index, docs, progress=False, vectors=vecs)
    bm25 = [h.doc_id for h in r.batch_search(["owl"], 3)[0]]
    assert set(bm25) == {"a", "b"}
    out = r.batch_search_vectors(["owl", "owl"], [[1.0, 0.1, 0, 0], [0.1, 1.0, 0, 0]], k=2, candidates=10)
    assert [h.doc_id for h in out[0]] == ["a", "b"] and [h.doc_id for h in out[1]] == ["b", "a"]
    assert out[0][0].score == pytest.approx(2.0, abs=0.01)  # cosine + 1 (defined by our script)
    # "c" is not a BM25 candidate, so the vector alone cannot bring it in.
    assert "c" not in [h.doc_id for h in r.batch_search_vectors(["owl"], [[0, 0, 1.0, 0]], k=3)[0]]
    r.close()


@pytest.mark.es
def test_secrets_never_reach_logs_or_errors(es_url, make_es_config, monkeypatch, caplog):
    monkeypatch.setenv("SONAR_TEST_ES_KEY", SECRET_KEY)
    cfg = make_es_config(es_url, api_key_env="SONAR_TEST_ES_KEY")
    r = _retriever(cfg)
    logged = {**r.params(), "repr": repr(r)}
    caplog.set_level(logging.DEBUG)
    messages = []
    for call in (lambda: r.batch_search(["zorvath"], 1), lambda: r.client.indices.exists(index=r.index)):
        try:
            call()  # noida-db ignores auth; a real cluster answers 401 -> bad_request
        except RetrievalError as e:
            messages.append(str(e))
            assert e.kind == "bad_request"
        except Exception as e:  # noqa: BLE001
            messages.append(repr(e))
    assert caplog.records  # elastic_transport logged the requests
    text = json.dumps(logged) + caplog.text + "\n".join(messages)
    assert SECRET_KEY not in text
    r.close()


# ------------------------------------------------------------------------------------ fault test
class StepClock:
    """Fake time for the breaker: the loop advances it, backoff sleeps add to it (no real sleeping)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


@pytest.mark.es
def test_server_killed_mid_run_breaker_opens_and_recovers_after_restart(restartable_es, make_es_config):
    """A rollout-like loop of searches while the server dies and comes back on the same port.

    Expectations: the first failed calls are retried (bounded) and come back as 'connection' errors;
    after breaker_failures failed calls the breaker opens and calls fail fast ('breaker_open') WITHOUT
    any request reaching the server; one probe per breaker_reset_s; after the restart the next probe
    succeeds, the breaker closes and results are correct again. Nothing raises out of the loop.
    """
    server = restartable_es
    cfg = make_es_config(server.url, request_timeout_s=2.0)
    es = _retriever(cfg)  # transport retries off: the ResilientRetriever owns retries
    es.create_index()
    bulk_index(es.client, es.index, DOCS, progress=False)
    clock = StepClock()
    rr = ResilientRetriever(es, max_retries=2, backoff_s=0.05, breaker_failures=3, breaker_reset_s=1.0,
                            clock=clock, sleep=clock.sleep, max_backoff_s=0.2)
    step_s = 0.1
    log: list[tuple[int, str, int]] = []  # (step, outcome, requests sent to the server so far)

    def search(step: int) -> None:
        i = step % 50
        try:
            hits = rr.batch_search([NAMES[i], NAMES[(i + 11) % 50]], 2)
        except RetrievalError as e:  # a failed search is data: the loop goes on
            log.append((step, e.kind, es.stats()["requests"]))
            return
        assert [h[0].doc_id for h in hits] == [DOCS[i]["id"], DOCS[(i + 11) % 50]["id"]]
        log.append((step, "ok", es.stats()["requests"]))

    step = 0
    for _ in range(5):  # healthy
        search(step)
        step += 1
        clock.t += step_s
    assert [o for _, o, _ in log] == ["ok"] * 5
    requests_before_kill = es.stats()["requests"]

    server.stop()  # killed mid-run (noida-db: terminate() on our Popen handle)
    down_steps = 35  # 3.5 s of (fake) downtime
    for _ in range(down_steps):
        search(step)
        step += 1
        clock.t += step_s
    down = log[5:]
    kinds = [o for _, o, _ in down]
    assert set(kinds) <= {"connection", "breaker_open"}, kinds
    assert kinds[:3] == ["connection"] * 3  # retried then failed
    assert kinds[3] == "breaker_open"  # opened after breaker_failures=3 failed calls
    n_fast = kinds.count("breaker_open")
    n_conn = kinds.count("connection")
    assert n_fast >= down_steps - 3 - 4
    # Requests that reached the dead server: 3 calls x (1 + 2 retries), then one probe per reset period.
    probes = n_conn - 3
    assert 1 <= probes <= 4
    sent_while_down = es.stats()["requests"] - requests_before_kill
    assert sent_while_down == 3 * 3 + probes
    # While open (between probes), no request at all reached the server.
    for (s0, o0, r0), (s1, o1, r1) in zip(down, down[1:]):
        if o1 == "breaker_open":
            assert r1 == r0
    st = rr.stats()
    assert st["breaker_opens"] == 1 and st["breaker_reopens"] == probes
    assert st["errors"]["connection"] == n_conn and st["errors"]["breaker_open"] == n_fast
    assert st["inner"]["errors"]["connection"] == sent_while_down

    server.start()  # same port (and, for noida-db, the same data dir)
    reindexed = _ensure_indexed(es)  # False with noida-db: it keeps its data on SIGTERM
    recovered_at = None
    for _ in range(20):
        search(step)
        if log[-1][1] == "ok" and recovered_at is None:
            recovered_at = step
        step += 1
        clock.t += step_s
    assert recovered_at is not None, log[-20:]
    # Recovery within one breaker_reset_s of fake time (the next probe), and every later call is ok.
    assert recovered_at - (5 + down_steps) <= int(1.0 / step_s) + 1
    after = [o for s, o, _ in log if s >= recovered_at]
    assert after == ["ok"] * len(after)
    assert rr.state == "closed" and rr.stats()["breaker_closes"] == 1
    es.close()
    print(f"fault test: {n_conn} connection failures, {n_fast} fast-fails, {probes} probes, "
          f"recovered at step {recovered_at}, reindexed={reindexed}")


def _ensure_indexed(es: ElasticRetriever) -> bool:
    """After a restart: True if the index had to be rebuilt (noida-db keeps its data on SIGTERM)."""
    try:
        if es.client.count(index=es.index)["count"] == len(DOCS):
            return False
    except Exception:  # noqa: BLE001 - the index did not survive
        pass
    es.create_index(recreate=True)
    bulk_index(es.client, es.index, DOCS, progress=False)
    return True


@pytest.mark.es
def test_background_search_loop_survives_kill_and_restart_in_real_time(restartable_es, make_es_config):
    """Same fault, real clock: a worker thread searches non-stop while the main thread kills the
    server, waits, and restarts it. No exception escapes the loop, the breaker keeps the dead server
    almost untouched (one probe per reset period of the outage), and searches are correct again after
    the restart."""
    import threading
    import time

    server = restartable_es
    es = _retriever(make_es_config(server.url, request_timeout_s=2.0))
    es.create_index()
    bulk_index(es.client, es.index, DOCS, progress=False)
    reset_s = 0.3
    rr = ResilientRetriever(es, max_retries=1, backoff_s=0.02, breaker_failures=2, breaker_reset_s=reset_s,
                            max_backoff_s=0.05)
    stop = threading.Event()
    outcomes: list[tuple[float, str]] = []
    escaped: list[BaseException] = []

    def loop():
        i = 0
        while not stop.is_set():
            j = i % 50
            try:
                hits = rr.batch_search([NAMES[j]], 1)
                outcomes.append((time.monotonic(), "ok" if hits[0][0].doc_id == DOCS[j]["id"] else "wrong"))
            except RetrievalError as e:
                outcomes.append((time.monotonic(), e.kind))
            except BaseException as e:  # noqa: BLE001 - the test fails on any
                escaped.append(e)
                return
            i += 1
            time.sleep(0.005)

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    try:
        wait_until(lambda: len(outcomes) >= 5 or escaped, what="the search loop to answer a few searches")
        n_before = len(outcomes)  # searches that finished before the server was stopped
        server.stop()  # returns once the process has exited
        t_kill, req_kill = time.monotonic(), es.stats()["requests"]
        # The outage itself (the behaviour under test): the loop keeps searching a dead server.
        wait_until(lambda: time.monotonic() - t_kill >= 1.0 and sum(t > t_kill + 0.05 for t, _ in outcomes) >= 20,
                   what="a second of outage with 20 searches in it")
        t_up, req_up = time.monotonic(), es.stats()["requests"]
        server.start()
        _ensure_indexed(es)
        wait_until(lambda: any(t > t_up and o == "ok" for t, o in outcomes) or escaped,
                   what="a correct search after the restart")
    finally:
        stop.set()
        worker.join(DEADLINE_S)
    assert not worker.is_alive(), "the search loop did not stop"
    assert not escaped, escaped
    assert "wrong" not in [o for _, o in outcomes]
    before = [o for _, o in outcomes[:n_before]]
    down = [o for t, o in outcomes if t_kill + 0.05 < t < t_up]
    after_ok = [t for t, o in outcomes if t > t_up and o == "ok"]
    assert before and set(before) == {"ok"}
    assert set(down) <= {"connection", "breaker_open"} and down.count("breaker_open") > down.count("connection")
    # At most: breaker_failures calls x (1 + max_retries) attempts, plus one probe per reset period
    # of the outage as it really lasted (+1 for a call already in flight when the process died).
    assert req_up - req_kill <= 2 * 2 + int((t_up - t_kill) / reset_s) + 1, (req_up - req_kill, len(down))
    assert after_ok, outcomes[-10:]
    assert rr.state == "closed"
    es.close()
