"""Question: what do single, batched and multi-query searches cost on a 200k-passage corpus, with and
without the result cache and with and without dense rerank; what does the Elasticsearch protocol add?

Measured in one run on a deterministic synthetic corpus (Zipf-distributed pseudo-words, ~100 words per
passage like the Search-R1 wiki chunks; nothing is downloaded). Reports QPS and p50/p99 per-call
latency for every workload, the ratios batched/single and cached/uncached (computed per repeat, so
they compare numbers measured seconds apart on the same machine), the tantivy build time, and the
Elasticsearch ``_msearch`` latency on a small fixture served by noida-db.

Query stream (same for every workload): GRPO-like. Each 64-query batch is 8 groups x 8 samples; a
group draws one question from a pool (with replacement, so questions recur across batches) and each
sample writes one of the question's 5 query variants (weights .5/.25/.12/.08/.05), so identical
queries occur inside a batch and across batches as they do in training. ``single`` sends that stream
one query per call, ``batched`` 64 per call, ``multiquery`` one RAG-R1 step per call (3 variants of a
question -> plan_step -> batch_search(k=K) -> dedupe_step, training's functions). ``cache`` runs put a fresh
CachedRetriever in front at the start of every repeat (its hit rate is the stream's own repetition).

Dense rerank: BM25 top-20, then MiniLM cosine -> top-3. The passage vectors of the 200k corpus are
random unit vectors (a stand-in: encoding 200k passages with MiniLM takes hours on 2 CPU cores; the
values do not change the cost of a rerank, which is one query forward pass plus a gather and a dot
product). The real passage-encoding rate is measured on a sample and reported (``build/...``).

Elasticsearch: noida-db (an ES-API server; its search is a linear scan) on a free 127.0.0.1 port with
the Popen handle kept and terminated at the end. Latency is measured on an empty index (``es/0docs/*``:
the protocol cost alone -- HTTP, JSON, client -- per call and per query) and on a ~500-document fixture
(``es/500docs/*``, dominated by noida's scan: ``es/scan_ms_per_doc_per_query``); tantivy on the
500-document fixture is the in-process reference (``tantivy_fixture/500docs/*``; Sonar's indexer refuses
an empty corpus, so there is no empty tantivy index).

Run: ``sonar bench retrieval [--quick]``. Corpus and index are cached under ``--work-dir``.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sonar.bench.common import REPO_ROOT, base_parser, setup_env, summarise, write_result  # noqa: E402

setup_env()

import numpy as np  # noqa: E402

FULL = dict(passages=200_000, questions=512, single_calls=400, batches=16, mq_steps=200, es_docs=(0, 500),
            es_single=30, es_batches=2, encode_sample=128)
QUICK = dict(passages=5_000, questions=128, single_calls=120, batches=4, mq_steps=60, es_docs=(0, 100),
             es_single=10, es_batches=2, encode_sample=16)
BATCH = 64
GROUP = 8
K = 3
RERANK_N = 20
VARIANT_P = np.array([0.5, 0.25, 0.12, 0.08, 0.05])


# ------------------------------------------------------------------------------------------ data

def make_questions(corpus: Path, n: int, n_passages: int, seed: int) -> list[list[str]]:
    """n questions, each 5 query variants written from one passage (title words, text words, noise)."""
    from sonar.retrieval.corpus import CorpusReader

    rng = np.random.default_rng(seed)
    rows = set(rng.choice(n_passages, size=n, replace=False).tolist())
    out = []
    for row, p in enumerate(CorpusReader(corpus)):
        if row not in rows:
            continue
        words = p.text.rstrip(".").split()[3:]
        pick = lambda m: " ".join(rng.choice(words, size=m, replace=False))  # noqa: E731
        out.append([
            f"{p.title} {pick(2)}",
            f"what is {pick(4)}?",
            p.title,
            f"{p.title}: {pick(3)}",
            f'"{pick(2)}" AND {pick(3)}',
        ])
    rng.shuffle(out)
    return out


def grpo_stream(questions: list[list[str]], n_queries: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out: list[str] = []
    while len(out) < n_queries:
        q = questions[int(rng.integers(len(questions)))]
        out.extend(q[int(rng.choice(5, p=VARIANT_P))] for _ in range(GROUP))
    return out[:n_queries]


def mq_steps(questions: list[list[str]], n_steps: int, seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    steps: list[list[str]] = []
    while len(steps) < n_steps:
        q = questions[int(rng.integers(len(questions)))]
        for _ in range(GROUP):
            steps.append([q[i] for i in rng.choice(5, size=3, replace=False, p=VARIANT_P)])
    return steps[:n_steps]


# --------------------------------------------------------------------------------------- timing

def timed_calls(fn, calls) -> np.ndarray:
    lat = np.empty(len(calls))
    for i, c in enumerate(calls):
        t0 = time.perf_counter()
        fn(c)
        lat[i] = time.perf_counter() - t0
    return lat


def run_workload(retriever, kind: str, stream: list[str], steps: list[list[str]], cfg: dict):
    from sonar.actors.multiquery import dedupe_step, plan_step

    if kind == "single":
        calls = [[q] for q in stream[: cfg["single_calls"]]]
        lat = timed_calls(lambda c: retriever.batch_search(c, K), calls)
        n_q = len(calls)
    elif kind == "batched":
        calls = [stream[i * BATCH:(i + 1) * BATCH] for i in range(cfg["batches"])]
        lat = timed_calls(lambda c: retriever.batch_search(c, K), calls)
        n_q = sum(len(c) for c in calls)
    else:
        calls = steps[: cfg["mq_steps"]]

        def step(qs):  # as training runs a step (actors/multiquery.py): budget 3, k hits, 1 document a query
            kept, _ = plan_step(qs, 3)
            return dedupe_step(retriever.batch_search(kept, K), 1)

        lat = timed_calls(step, calls)
        n_q = sum(len(c) for c in calls)
    return {"qps": n_q / lat.sum(), "p50_ms": 1e3 * float(np.median(lat)), "p99_ms": 1e3 * float(np.percentile(lat, 99)),
            "ms_per_query": 1e3 * lat.sum() / n_q}


# -------------------------------------------------------------------------------- elasticsearch

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Noida:
    """noida-db started by us; stopped through our own Popen handle (and its own process group)."""

    def __init__(self, data_dir: Path):
        from importlib.resources import files

        binary = Path(str(files("noida_db").joinpath("noida-db")))
        argv = [str(binary)] if binary.is_file() and os.access(binary, os.X_OK) else [shutil.which("noida-db") or "noida-db"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(data_dir / "noida.log", "ab")
        self.proc = subprocess.Popen(argv + ["start", "--only", "elasticsearch", "--elasticsearch-port", str(self.port),
                                             "--host", "127.0.0.1", "--data-dir", str(data_dir)],
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        import urllib.request

        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"noida-db exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url, timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"noida-db did not answer on {self.url}")
                time.sleep(0.05)

    def stop(self):
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group of the process we started, nothing else
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def bench_elastic(corpus: Path, stream: list[str], cfg: dict, repeats: int, work: Path) -> tuple[dict, dict]:
    """Returns (per-repeat metric samples, notes)."""
    try:
        from sonar.retrieval.elastic import ElasticRetriever, bulk_index
    except ImportError as e:
        return {}, {"elasticsearch": f"skipped: retrieval.elastic not importable ({e})"}
    from sonar.cluster.wire.config import ElasticConfig
    from sonar.retrieval.corpus import CorpusReader
    from sonar.retrieval.tantivy_index import TantivyRetriever, build_index

    samples: dict[str, list[float]] = {}
    d = Path(tempfile.mkdtemp(prefix="sonar-es-", dir=work))
    try:
        server = Noida(d)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(d, ignore_errors=True)
        return {}, {"elasticsearch": f"skipped: noida-db did not start ({e})"}
    per_query: dict[int, list[float]] = {}
    try:
        for n_docs in cfg["es_docs"]:
            sub = d / f"corpus{n_docs}.jsonl"
            with open(sub, "w") as f:
                for i, p in enumerate(CorpusReader(corpus)):
                    if i == n_docs:
                        break
                    f.write(json.dumps({"id": p.doc_id, "title": p.title, "text": p.text}) + "\n")
            # noida-db scans linearly (~0.1-0.2 ms per doc per query): a 64-query _msearch over 500 docs
            # takes seconds, more on a busy machine, so the client timeout is generous here.
            es = ElasticRetriever.from_config(ElasticConfig(hosts=[server.url], index=f"bench{n_docs}",
                                                            request_timeout_s=300.0))
            es.create_index(recreate=True)
            pair = [("es", es)]
            if n_docs > 0:  # an empty corpus is refused by CorpusReader (CorpusError): the 0-doc index stays empty
                bulk_index(es.client, es.index, ({"id": p.doc_id, "title": p.title, "text": p.text}
                                                 for p in CorpusReader(sub)), progress=False)
                # the in-process reference, on the same documents
                build_index(sub, d / f"tantivy{n_docs}", progress=False)
                pair.append(("tantivy_fixture", TantivyRetriever(d / f"tantivy{n_docs}")))
            es.batch_search(stream[:4], K)  # warm the connection
            small = dict(cfg, single_calls=cfg["es_single"], batches=cfg["es_batches"])
            per_query[n_docs] = []
            for _ in range(repeats):
                for name, r in pair:
                    for kind in ("single", "batched"):
                        m = run_workload(r, kind, stream, [], small)
                        for key in ("p50_ms", "qps", "ms_per_query"):
                            samples.setdefault(f"{name}/{n_docs}docs/{kind}/{key}", []).append(m[key])
                        if name == "es" and kind == "single":
                            per_query[n_docs].append(m["p50_ms"])
            es.close()
        (a, b) = cfg["es_docs"]
        for pa, pb in zip(per_query[a], per_query[b]):
            samples.setdefault("es/scan_ms_per_doc_per_query", []).append((pb - pa) / (b - a))
        notes = {"elasticsearch": f"noida-db on {server.url}; fixtures of {cfg['es_docs']} docs; the empty index "
                                  f"measures the protocol cost alone (es/0docs/*: HTTP + JSON + client per call)"}
    except Exception as e:  # noqa: BLE001 - the tantivy numbers above must still be written
        notes = {"elasticsearch": f"failed: {type(e).__name__}: {e}"}
        samples = {}  # partial ES numbers would mislead; the note says what failed
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)
    return samples, notes


# ---------------------------------------------------------------------------------------- main

# bench/README.md's rendering of a result (pure: no runs; `sonar bench readme`, tests/bench/test_readme_blocks.py)

def _sig3(v: float) -> str:
    """Three significant figures (thousands separated): 2,115, 848, 55.2, 9.87."""
    return f"{v:,.0f}" if abs(v) >= 99.95 else f"{v:.1f}" if abs(v) >= 9.995 else f"{v:.2f}"


def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's retrieval table: queries/s per workload (median [min, max] over repeats), BM25 and
    BM25 + rerank, without and with the cache in front (the cache's hit rate beside BM25's)."""
    from sonar.bench.common import readme_block

    m, cfg = doc["metrics"], doc["config"]
    kinds = ("single", "batched", "multiquery")

    def qps(tag: str, spread: bool = True, hit: bool = False) -> str:
        s = m[f"{tag}/qps"]
        out = _sig3(s["median"]) + (f" [{_sig3(s['min'])}, {_sig3(s['max'])}]" if spread else "")
        return out + (f" ({m[f'{tag}/hit_rate']['median']:.2f})" if hit else "")

    rows = (("BM25 (tantivy), no cache: queries/s", "bm25", "nocache", True, False),
            ("BM25, cache in front: queries/s (hit rate)", "bm25", "cache", False, True),
            (f"BM25 top-{cfg['rerank_n']} + MiniLM rerank, no cache: queries/s", "dense", "nocache", True, False),
            ("rerank, cache in front: queries/s", "dense", "cache", False, False))
    lines = [f"| | single (1 query per call) | batched ({cfg['batch']} per call) | multi-query (3 per call) |",
             "|---|---|---|---|"]
    for label, stage, cache, spread, hit in rows:
        lines.append(f"| {label} | " + " | ".join(qps(f"{stage}/{k}/{cache}", spread, hit) for k in kinds) + " |")
    return readme_block("retrieval", json_name, lines)


def main(argv=None) -> int:
    p = base_parser("retrieval", __doc__.split("\n")[0])
    p.add_argument("--work-dir", default=None, help="where corpus/index are cached (default runs/bench-retrieval[-quick])")
    p.add_argument("--passages", type=int, default=None, help="override the corpus size")
    p.add_argument("--no-es", action="store_true", help="skip the Elasticsearch part")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    cfg = dict(QUICK if args.quick else FULL)
    if args.passages:
        cfg["passages"] = args.passages
    repeats = args.repeats or (1 if args.quick else 3)
    work = Path(args.work_dir or REPO_ROOT / "runs" / ("bench-retrieval-quick" if args.quick else "bench-retrieval"))
    work.mkdir(parents=True, exist_ok=True)

    from sonar.retrieval.cache import CachedRetriever
    from sonar.retrieval.corpus import corpus_fingerprint, write_synthetic_corpus
    from sonar.retrieval.rerank import DenseEncoder, DenseReranker, PassageVectors, passage_text, vectors_dir
    from sonar.retrieval.tantivy_index import TantivyRetriever, build_index

    samples: dict[str, list[float]] = {}
    add = lambda k, v: samples.setdefault(k, []).append(float(v))  # noqa: E731
    t_start = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]

    # corpus + index (cached between runs), and one fresh timed build
    corpus = work / f"synthetic-{cfg['passages']}.jsonl"
    if not corpus.exists():
        t0 = time.perf_counter()
        write_synthetic_corpus(corpus, cfg["passages"], seed=0)
        add("build/generate_corpus_s", time.perf_counter() - t0)
    fresh = Path(tempfile.mkdtemp(prefix="idx-", dir=work))
    info = build_index(corpus, fresh, progress=not args.quick)
    add("build/index_s", info.seconds)
    add("build/index_docs_per_s", info.num_docs / info.seconds)
    t0 = time.perf_counter()
    assert build_index(corpus, fresh, progress=False).reused
    add("build/index_reuse_ms", 1e3 * (time.perf_counter() - t0))
    index_dir = work / f"index-{corpus_fingerprint(corpus)}"
    if not index_dir.exists():
        shutil.move(str(fresh), index_dir)
    else:
        shutil.rmtree(fresh)
    bm25 = TantivyRetriever(index_dir)

    encoder = DenseEncoder()
    vdir = vectors_dir(index_dir, encoder.tag)
    if (vdir / "meta.json").exists():
        vectors = PassageVectors(vdir)
    else:
        from sonar.retrieval.corpus import CorpusReader

        ids = [x.doc_id for x in CorpusReader(corpus)]
        rng = np.random.default_rng(0)
        m = rng.standard_normal((len(ids), encoder.dim)).astype(np.float32)
        m /= np.linalg.norm(m, axis=1, keepdims=True)
        vectors = PassageVectors.write(vdir, ids, m, model=encoder.tag, fingerprint="random-stand-in")
    from sonar.retrieval.corpus import CorpusReader

    sample = [passage_text(x) for _, x in zip(range(cfg["encode_sample"]), CorpusReader(corpus))]
    encoder.encode(sample[:4])
    t0 = time.perf_counter()
    encoder.encode(sample, batch_size=32)
    per_passage = (time.perf_counter() - t0) / len(sample)
    add("build/dense_encode_ms_per_passage", 1e3 * per_passage)
    add("build/dense_encode_corpus_h_estimate", per_passage * cfg["passages"] / 3600)
    dense = DenseReranker(bm25, encoder, n=RERANK_N, vectors=vectors)

    questions = make_questions(corpus, cfg["questions"], cfg["passages"], seed=1)
    n_stream = max(cfg["single_calls"], cfg["batches"] * BATCH)
    stream = grpo_stream(questions, n_stream, seed=2)
    steps = mq_steps(questions, cfg["mq_steps"], seed=3)
    bm25.batch_search(stream[:8], K)  # warm the page cache and the encoder
    dense.batch_search(stream[:8], K)

    kinds = ("single", "batched", "multiquery")
    for rep in range(repeats):
        rep_m = {}
        for stage, base in (("bm25", bm25), ("dense", dense)):
            for kind in kinds:
                for cached in (False, True):
                    r = CachedRetriever(base, 4096, "dense" if stage == "dense" else "none") if cached else base
                    m = run_workload(r, kind, stream, steps, cfg)
                    tag = f"{stage}/{kind}/{'cache' if cached else 'nocache'}"
                    for key, v in m.items():
                        add(f"{tag}/{key}", v)
                    if cached:
                        add(f"{tag}/hit_rate", r.stats()["hit_rate"])
                    rep_m[tag] = m
        for stage in ("bm25", "dense"):
            add(f"ratio/{stage}/batched_over_single_qps",
                rep_m[f"{stage}/batched/nocache"]["qps"] / rep_m[f"{stage}/single/nocache"]["qps"])
            for kind in kinds:
                add(f"ratio/{stage}/{kind}/cached_over_uncached_qps",
                    rep_m[f"{stage}/{kind}/cache"]["qps"] / rep_m[f"{stage}/{kind}/nocache"]["qps"])
        for kind in kinds:
            add(f"ratio/dense_over_bm25/{kind}/ms_per_query",
                rep_m[f"dense/{kind}/nocache"]["ms_per_query"] / rep_m[f"bm25/{kind}/nocache"]["ms_per_query"])

    notes = {"passage_vectors": "random unit vectors (stand-in, see docstring); real MiniLM rate in build/dense_encode_*",
             "stream": f"GRPO-like: {BATCH}-query batches of {GROUP} groups x {GROUP} samples, 5 variants/question",
             "unique_queries_in_stream": len(set(stream))}
    if not args.no_es:
        es_samples, es_notes = bench_elastic(corpus, stream, cfg, repeats, work)
        for k, v in es_samples.items():
            samples.setdefault(k, []).extend(v)
        notes.update(es_notes)
    else:
        notes["elasticsearch"] = "skipped (--no-es)"
    notes["wall_s"] = round(time.perf_counter() - t_start, 1)
    notes["loadavg_start"], notes["loadavg_end"] = load_start, [round(x, 2) for x in os.getloadavg()]

    metrics = {k: summarise(v) for k, v in sorted(samples.items())}
    config = dict(cfg, quick=args.quick, repeats=repeats, k=K, rerank_n=RERANK_N, batch=BATCH, group=GROUP,
                  threads=1, corpus=str(corpus), num_docs=bm25.num_docs, encoder=encoder.tag)

    def plot(png: Path):
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        labels, qps_nc, qps_c = [], [], []
        for stage in ("bm25", "dense"):
            for kind in kinds:
                labels.append(f"{stage}\n{kind}")
                qps_nc.append(metrics[f"{stage}/{kind}/nocache/qps"]["median"])
                qps_c.append(metrics[f"{stage}/{kind}/cache/qps"]["median"])
        x = np.arange(len(labels))
        axes[0].bar(x - 0.2, qps_nc, 0.4, label="no cache")
        axes[0].bar(x + 0.2, qps_c, 0.4, label="cache")
        axes[0].set_yscale("log")
        axes[0].set_xticks(x, labels, fontsize=8)
        axes[0].set_ylabel("queries / s (median over repeats)")
        axes[0].set_title(f"QPS, {bm25.num_docs:,} passages, 1 thread")
        axes[0].legend()
        p50 = [metrics[f"{s}/{k}/nocache/p50_ms"]["median"] for s in ("bm25", "dense") for k in kinds]
        p99 = [metrics[f"{s}/{k}/nocache/p99_ms"]["median"] for s in ("bm25", "dense") for k in kinds]
        axes[1].bar(x - 0.2, p50, 0.4, label="p50")
        axes[1].bar(x + 0.2, p99, 0.4, label="p99")
        axes[1].set_yscale("log")
        axes[1].set_xticks(x, labels, fontsize=8)
        axes[1].set_ylabel("ms per call (no cache)")
        axes[1].set_title("Latency per call (single: 1 query, batched: 64, multiquery: 3)")
        axes[1].legend()
        fig.tight_layout()
        fig.savefig(png, dpi=110)

    path = write_result("retrieval", config, metrics, plot, out_dir=args.out, extra={"notes": notes})
    print(f"wrote {path}")
    for k in ("build/index_s", "bm25/single/nocache/p50_ms", "bm25/batched/nocache/p50_ms",
              "ratio/bm25/batched_over_single_qps", "ratio/bm25/batched/cached_over_uncached_qps",
              "dense/single/nocache/p50_ms", "es/0docs/single/p50_ms", "es/0docs/batched/ms_per_query"):
        if k in metrics:
            print(f"  {k}: {metrics[k]['median']:.3f}")
    if notes["elasticsearch"].startswith("failed"):
        # The tantivy numbers are written, but a run whose Elasticsearch part broke is not a success.
        print(f"retrieval: the Elasticsearch part failed ({notes['elasticsearch']}); its metrics are absent",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
