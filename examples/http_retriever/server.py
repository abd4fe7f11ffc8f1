"""A search server of your own, as Sonar's HTTP backend (``retrieval.backend=http``) expects it: Search-R1's
``/retrieve`` API over a JSONL corpus (one ``{"id", "title", "text"}`` per line), ranked by BM25.

    python examples/http_retriever/server.py --corpus examples/own_data/hotpot_mini_corpus.jsonl --port 8000

The wire (``retrieval/http_backend.py`` has the details and the failure kinds):

* request: ``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}``;
* answer: ``{"result": [hits of query 0, ...]}``, each hit ``{"document": {"id", "contents"}, "score"}``
  (without ``return_scores``: the document alone); ``contents`` is the title on its first line, then
  the text, as wiki-18's corpus lines are.

Replace ``Index`` with your engine (a FAISS index, a web search API, Elasticsearch): the wire stays. The
server binds 127.0.0.1 unless told otherwise; it uses only the standard library.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


def load_corpus(path: str) -> list[dict]:
    """The corpus's records; a line without ``id``, ``title`` or ``text`` is refused with its number."""
    docs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                doc = json.loads(line)
                missing = [k for k in ("id", "title", "text") if k not in doc]
                if missing:
                    raise ValueError(f"{path}:{n}: the record has no {missing}")
                docs.append(doc)
    return docs


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class Index:
    """BM25 (k1 = 1.2, b = 0.75) over title and text."""

    def __init__(self, docs: list[dict], k1: float = 1.2, b: float = 0.75):
        self.docs, self.k1, self.b = docs, k1, b
        self.tf = [Counter(_words(f"{d['title']} {d['text']}")) for d in docs]
        self.len = [sum(tf.values()) for tf in self.tf]
        self.avg = sum(self.len) / max(len(docs), 1)
        df = Counter(w for tf in self.tf for w in tf)
        self.idf = {w: math.log(1 + (len(docs) - n + 0.5) / (n + 0.5)) for w, n in df.items()}

    def search(self, query: str, k: int) -> list[tuple[float, dict]]:
        """The best ``k`` documents sharing a word with the query, (score, record), best first."""
        scored = []
        for i, tf in enumerate(self.tf):
            s = sum(self.idf[w] * tf[w] * (self.k1 + 1) / (tf[w] + self.k1 * (1 - self.b + self.b * self.len[i] / self.avg))
                    for w in set(_words(query)) if w in tf)
            if s > 0:
                scored.append((s, i))
        scored.sort(key=lambda x: (-x[0], x[1]))
        return [(s, self.docs[i]) for s, i in scored[:k]]


def answer(index: Index, body: dict) -> dict:
    """The ``/retrieve`` answer to one request body."""
    out = []
    for q in body["queries"]:
        hits = [({"id": str(d["id"]), "contents": f'"{d["title"]}"\n{d["text"]}'}, s)
                for s, d in index.search(q, int(body.get("topk", 3)))]
        out.append([{"document": d, "score": s} for d, s in hits] if body.get("return_scores") else [d for d, _ in hits])
    return {"result": out}


def make_server(docs: list[dict], host: str = "127.0.0.1", port: int = 8000,
                on_request: Callable[[dict], None] | None = None) -> ThreadingHTTPServer:
    """The server (not yet serving: call ``serve_forever``); port 0 picks a free one
    (``server.server_address[1]``). ``on_request(body)``: called with each request's body, for a log."""
    index = Index(docs)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            if self.path != "/retrieve":
                self.send_error(404)
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not isinstance(body.get("queries"), list):
                    raise ValueError("queries must be a list")
            except (ValueError, TypeError, KeyError) as e:
                self.send_error(422, str(e))
                return
            if on_request is not None:
                on_request(body)
            payload = json.dumps(answer(index, body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="JSONL, one {id, title, text} per line")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    server = make_server(load_corpus(args.corpus), args.host, args.port)
    print(f"serving http://{args.host}:{server.server_address[1]}/retrieve", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
