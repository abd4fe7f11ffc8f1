"""Issue 54, finding 2: one document (or question) with a lone UTF-16 surrogate, ``\\ud83d`` in its JSON (a
truncated emoji in scraped text), crashed every rollout worker that retrieved it (a tokenizer ``TypeError``),
``sonar index`` (tantivy's ``UnicodeEncodeError``) and start-up. Every entry of outside text now goes
through ``cluster/wire/text.py: clean_text``: the corpus reader, the dataset loader, the HTTP and
Elasticsearch hit parsers, the reranker's passage text and the token door ``prompts.neutralise``."""
import json

import pytest

from sonar.cluster.wire.text import REPLACEMENT, clean_text

LONE = json.loads('"\\ud83d"')  # what json.loads makes of the escape: a str holding one lone surrogate


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sonar.retrieval.rerank import packaged_minilm_dir

    return AutoTokenizer.from_pretrained(str(packaged_minilm_dir()))


def test_clean_text_replaces_lone_surrogates_and_joins_split_pairs(tokenizer):
    with pytest.raises(TypeError):
        tokenizer(f"smile {LONE} here")  # what crashed the workers
    assert clean_text(f"smile {LONE} here") == f"smile {REPLACEMENT} here"
    assert clean_text("\ud83d\ude00") == "\U0001F600"  # a pair that arrived as two code points
    plain = "nothing to repair: é, 日本, \U0001F600"
    assert clean_text(plain) is plain
    assert tokenizer(clean_text(f"smile {LONE} here"))["input_ids"]


def test_a_corpus_document_with_one_is_indexed_and_searched(tmp_path, tokenizer):
    import dataclasses

    from sonar.cluster.wire.config import RetrievalConfig
    from sonar.retrieval.corpus import CorpusReader
    from sonar.retrieval.factory import build_retriever
    from sonar.retrieval.rerank import passage_text

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "d1", "title": "Emoji\\ud83d", "text": "a truncated emoji \\ud83d in scraped text"}\n'
                      '{"id": "d2", "title": "Other", "text": "an ordinary passage"}\n')
    (p, _) = list(CorpusReader(corpus))
    assert p.text == f"a truncated emoji {REPLACEMENT} in scraped text" and p.title == f"Emoji{REPLACEMENT}"
    r = build_retriever(dataclasses.replace(RetrievalConfig(), cache_size=0), str(corpus), str(tmp_path / "ix"))
    (hits,) = r.batch_search(["truncated emoji"], 1)
    assert hits[0].doc_id == "d1" and tokenizer(passage_text(hits[0]))["input_ids"]


def test_http_and_elasticsearch_hits_with_one_are_repaired():
    from sonar.retrieval.http_backend import parse_answer

    raw = b'{"result": [[{"document": {"id": "x\\ud83d", "contents": "\\"T\\ud83d\\"\\nbody \\ud83d"}, "score": 1.0}]]}'
    (hits,) = parse_answer(raw, 1, 1)
    assert (hits[0].doc_id, hits[0].title, hits[0].text) == (f"x{REPLACEMENT}", f"T{REPLACEMENT}", f"body {REPLACEMENT}")
    from sonar.retrieval.elastic import ElasticRetriever

    es = ElasticRetriever(client=None, index="i", hosts=["http://127.0.0.1:9200"])  # the _msearch answer's parser
    answer = json.loads('{"hits": {"hits": [{"_id": "e\\ud83d", "_score": 2.0, '
                        '"_source": {"title": "T\\ud83d", "text": "body \\ud83d"}}]}}')
    ((hit,),) = es._parse(1, 1, [0], [answer])
    assert (hit.doc_id, hit.title, hit.text) == (f"e{REPLACEMENT}", f"T{REPLACEMENT}", f"body {REPLACEMENT}")


def test_a_dataset_question_with_one_loads_and_a_plugins_hit_is_neutralised(tmp_path, tokenizer):
    from sonar.actors.datasets import load_datasets
    from sonar.actors.prompts import neutralise

    data = tmp_path / "dev.jsonl"
    data.write_text('{"id": "q1", "question": "who wrote \\ud83d this?", "golden_answers": ["a\\ud83d"]}\n')
    (item,) = load_datasets([str(data)])
    assert item.question == f"who wrote {REPLACEMENT} this?" and item.golds == [f"a{REPLACEMENT}"]
    # a retriever or tool plug-in may hand over anything: the token door repairs it too
    assert tokenizer(neutralise(f"doc {LONE}", ["</documents>"]))["input_ids"]


def test_a_huge_document_is_cut_in_characters_before_tokenizing(tokenizer, monkeypatch):
    """Issue 54, finding 6: three 10 MB documents were tokenized whole before the cut to max_doc_tokens
    (76 s, 1.2 GB); the cut in characters first keeps the same first tokens."""
    from sonar.actors import prompts
    from sonar.actors.prompts import get_protocol, render_documents

    huge = " ".join(f"word{i % 997}" for i in range(2_000_000))  # ~15 MB
    seen = []
    real = prompts._encode
    monkeypatch.setattr(prompts, "_encode", lambda tok, text: seen.append(len(text)) or real(tok, text))
    tags = get_protocol("search_r1")
    for style in ("short", "search_r1"):
        seen.clear()
        ids = render_documents(tags, [[("Huge", huge)]], tokenizer, 64, style=style)
        assert max(seen) <= 64 * prompts.MAX_CHARS_PER_TOKEN + 64 and ids
    # the first max tokens are unchanged by the character cut
    full = tokenizer.encode(huge[:100_000], add_special_tokens=False)[:64]
    assert tokenizer.encode(prompts.cap_chars(huge, 64), add_special_tokens=False)[:64] == full


def test_an_http_answer_past_the_size_cap_is_refused_unread():
    import http.server
    import threading

    from sonar.retrieval.base import RetrievalError
    from sonar.retrieval.http_backend import HTTPRetriever

    class Big(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(4 << 20))
            self.end_headers()
            try:
                self.wfile.write(b"x" * (4 << 20))
            except OSError:
                pass

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Big)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        r = HTTPRetriever(f"http://127.0.0.1:{srv.server_address[1]}/retrieve", max_response_bytes=1 << 20)
        with pytest.raises(RetrievalError, match="larger than retrieval.http.max_response_mb=1 MiB"):
            r.batch_search(["q"], 1)
        import asyncio

        with pytest.raises(RetrievalError, match="larger than"):
            asyncio.run(r.abatch_search(["q"], 1))
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_byte_dripping_server_is_a_timeout_not_a_stall():
    """Issue 54, finding 8: the blocking HTTP path's timeout was per socket read, so a server dripping a byte
    at a time held a search 40 s against timeout_s=3. Now the whole answer must come within timeout_s."""
    import http.server
    import threading

    from sonar.retrieval.base import RetrievalError
    from sonar.retrieval.http_backend import HTTPRetriever

    stop = threading.Event()

    class Drip(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                while not stop.wait(0.05):  # a byte every 50 ms: every read answers well inside timeout_s
                    self.wfile.write(b" ")
                    self.wfile.flush()
            except OSError:
                pass

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = HTTPRetriever(f"http://127.0.0.1:{srv.server_address[1]}/retrieve", timeout_s=1.0)
        with pytest.raises(RetrievalError, match=r"\[timeout\].*answer within 1.0 s"):
            r.batch_search(["q"], 1)
    finally:
        stop.set()
        srv.shutdown()
        srv.server_close()
