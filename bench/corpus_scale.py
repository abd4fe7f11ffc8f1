"""``sonar bench corpus-scale``: does a Wikipedia-size corpus start, index and serve, and what would the
papers' 21 M passages cost?

Question (issue 53): with a 1 M-passage corpus, how long do the BM25 index and the dense vectors take to
build and at what peak memory; does a run with the dense reranker start in about the time it takes
without it (the reranker encodes only its candidates, at query time); does a dense build killed halfway
resume without redoing its finished shards; what do BM25, BM25 + rerank and the dense backend answer
under concurrent load; and what do the measured rates give for the DPR Wikipedia split Search-R1 and
R1-Searcher search (21,015,324 passages)?

Every phase runs in a child process of its own (its wall time, and its peak RSS from
``VmHWM``, are its alone), on a deterministic synthetic corpus
(``corpus.write_synthetic_corpus``: Zipf words, ~100 per passage like the wiki-18 chunks; nothing is
downloaded):

- ``bm25``: ``ensure_index`` (what ``sonar index`` and a run's start-up call) on the corpus.
- ``startup-none`` / ``startup-dense``: a fresh process opens the finished index with
  ``build_retriever`` (``rerank=none``, then ``rerank=dense`` with MiniLM) and answers one batch: the
  retrieval side of a run's start-up, interpreter and imports included.
- ``minilm``: MiniLM's passage-encoding rate on a sample (batches of 64, this machine's threads).
- ``dense-kill`` / ``dense-resume``: ``build_passage_vectors`` over the whole corpus with a **stand-in
  encoder** (a randomly initialised one-layer BERT of width 64 with MiniLM's tokenizer: the same code path,
  shards, memmap and checksums, at a cost this machine can pay for 1 M passages; its vectors rank nothing
  meaningfully). The first child SIGKILLs itself at the first shard boundary past half the corpus; the
  second resumes and reports how many passages it encoded.
- ``serve``: BM25 (tantivy), BM25 top-20 + MiniLM rerank (candidates encoded at query time, vector cache
  on), and the dense backend (stand-in vectors: exact inner product over all of them), each under 1, 4
  and 16 client threads sending batches of 8 queries (the retrieval service runs concurrent batches in
  threads the same way): queries/s and per-batch p50/p99.

The 21 M projection (``projection`` in the JSON, each figure with its formula): BM25 and MiniLM at the
rates measured here; MiniLM on GPUs from its FLOP per passage (2 x 22.7 M parameters x the sample's mean
tokens) at an assumed 40 % of an H100's 989 TFLOP/s (the learner's MFU assumption in
``bench/sim/reference.py``); the vector store's bytes (float16); exact dense search as a full read of
that store per batch at this machine's measured bytes/s and at an H100's 3.35 TB/s.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from sonar.bench.common import REPO_ROOT, base_parser, readme_block, setup_env, summarise, write_result

NAME = "corpus-scale"
FULL = dict(passages=1_000_000, minilm_sample=512, shard_rows=16_384, queries=1024, rerank_queries=48,
            clients=[1, 4, 16], batch=8)
QUICK = dict(passages=20_000, minilm_sample=64, shard_rows=2048, queries=96, rerank_queries=16, clients=[1, 4], batch=8)
WIKI18_PASSAGES = 21_015_324
"""Passages of the DPR Wikipedia split (``psgs_w100``, 100-word chunks of the 2018-12-20 dump) that Search-R1's
``wiki-18.jsonl`` and R1-Searcher's retriever index (Karpukhin et al. 2020, Table 1: 21,015,324)."""
MINILM_PARAMS = 22.7e6
"""all-MiniLM-L6-v2's parameters (its model.safetensors: 90.9 MB of float32 = 22.7 M)."""
H100_BF16_FLOPS = 989e12
"""H100 SXM dense bf16 peak (NVIDIA H100 datasheet), as ``bench/sim/reference.py`` uses it."""
H100_HBM_BYTES_S = 3.35e12
"""H100 SXM HBM3 bandwidth (NVIDIA H100 datasheet)."""
ASSUMED_MFU = 0.40
"""The share of peak an encoder reaches (assumed; the learner's ``LEARNER_MFU`` in bench/sim/reference.py)."""
RERANK_N = 20
K = 3
STAND_IN = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                max_position_embeddings=512)


# ------------------------------------------------------------------------------------------- phases
def _rss_mb() -> float:
    """This process's peak RSS in MB: ``VmHWM`` (getrusage's ``ru_maxrss`` would also count the parent's
    pages at the fork that started it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _rcfg(work: Path, **kw):
    import dataclasses

    from sonar.cluster.wire.config import DenseIndexConfig, RetrievalConfig

    dense = kw.pop("dense", {})
    return dataclasses.replace(RetrievalConfig(), corpus=str(work / "corpus.jsonl"), index_dir=str(work / "index"),
                               cache_size=0, dense=dataclasses.replace(DenseIndexConfig(), **dense), **kw)


def stand_in_encoder_dir(work: Path) -> Path:
    """The stand-in encoder (see the module docstring), written once under ``work``."""
    d = work / "stand-in-encoder"
    if not (d / "config.json").is_file():
        import torch
        from transformers import AutoTokenizer, BertConfig, BertModel

        from sonar.retrieval.rerank import packaged_minilm_dir

        tok = AutoTokenizer.from_pretrained(str(packaged_minilm_dir()))
        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=tok.vocab_size, **STAND_IN)).eval().save_pretrained(d)
        tok.save_pretrained(d)
    return d


def queries_of(work: Path, n: int) -> list[str]:
    """``n`` queries written from random passages of the corpus (title + a few of its words)."""
    import numpy as np

    from sonar.retrieval.corpus import CorpusReader

    rng = np.random.default_rng(7)
    out = []
    for p in CorpusReader(work / "corpus.jsonl"):
        if len(out) >= n:
            break
        if rng.random() < 0.01:
            words = p.text.rstrip(".").split()[3:]
            out.append(f"{p.title} {' '.join(rng.choice(words, size=3, replace=False))}")
    return out


def phase(name: str, work: Path, cfg: dict) -> dict:
    """One phase, in this (child) process; its result with ``peak_rss_mb``."""
    t0 = time.perf_counter()
    out: dict = {}
    if name == "bm25":
        from sonar.retrieval.indexer import ensure_index

        rep = ensure_index(_rcfg(work), str(work / "corpus.jsonl"), str(work), resume=True)
        out.update(docs=rep.num_docs, reused=rep.reused)
        out["index_bytes"] = sum(f.stat().st_size for f in (work / "index").rglob("*") if f.is_file())
    elif name in ("startup-none", "startup-dense"):
        from sonar.retrieval.factory import build_retriever

        r = build_retriever(_rcfg(work, rerank=name.split("-")[1], rerank_candidates=RERANK_N, k=K),
                            str(work / "corpus.jsonl"), str(work))
        out["ready_s"] = time.perf_counter() - t0
        r.batch_search(queries_of(work, cfg["batch"]), K)
        out["first_batch_s"] = time.perf_counter() - t0 - out["ready_s"]
        out["encoded"] = getattr(r, "stats", dict)().get("encoded", 0)
    elif name == "minilm":
        import torch

        from sonar.retrieval.corpus import CorpusReader
        from sonar.retrieval.rerank import DenseEncoder, passage_text

        torch.set_num_threads(os.cpu_count() or 1)
        enc = DenseEncoder()
        sample = [passage_text(p) for _, p in zip(range(cfg["minilm_sample"]), CorpusReader(work / "corpus.jsonl"))]
        enc.encode(sample[:8])
        t1 = time.perf_counter()
        enc.encode(sample, batch_size=64)
        s = time.perf_counter() - t1
        tokens = [len(enc.tokenizer(t, truncation=True, max_length=enc.max_length)["input_ids"]) for t in sample]
        out.update(passages=len(sample), seconds=s, passages_per_s=len(sample) / s, threads=torch.get_num_threads(),
                   mean_tokens=sum(tokens) / len(tokens))
    elif name in ("dense-kill", "dense-resume"):
        from sonar.retrieval.rerank import DenseEncoder, build_passage_vectors

        enc = DenseEncoder(stand_in_encoder_dir(work), max_length=128)
        if name == "dense-kill":
            half, real = cfg["passages"] // 2, enc.encode

            def dying(texts, batch_size=None):  # called at the start of each shard, after the last one's meta
                if enc.texts_encoded >= half:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(texts, batch_size=batch_size)
            enc.encode = dying
        v = build_passage_vectors(work / "corpus.jsonl", work / "index", enc, progress=False, chunk=cfg["shard_rows"])
        out.update(encoded=enc.texts_encoded, vectors=len(v), vector_bytes=v.matrix.nbytes)
    elif name == "serve":
        out = serve(work, cfg)
    else:
        raise ValueError(f"unknown phase {name!r}")
    out.update(wall_s=time.perf_counter() - t0, peak_rss_mb=_rss_mb())
    return out


def load(retriever, queries: list[str], clients: int, batch: int) -> dict:
    """``clients`` threads send the batches of ``queries`` (``batch`` each) until none is left."""
    import numpy as np

    batches = [queries[i:i + batch] for i in range(0, len(queries), batch)]
    lock, lat, nxt = threading.Lock(), [], [0]

    def client():
        while True:
            with lock:
                if nxt[0] >= len(batches):
                    return
                b = batches[nxt[0]]
                nxt[0] += 1
            t = time.perf_counter()
            retriever.batch_search(b, K)
            with lock:
                lat.append(time.perf_counter() - t)
    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    a = np.array(lat) * 1e3
    return {"qps": len(queries) / wall, "batch_ms_p50": float(np.percentile(a, 50)),
            "batch_ms_p99": float(np.percentile(a, 99)), "batches": len(batches)}


def serve(work: Path, cfg: dict) -> dict:
    from sonar.retrieval.dense_index import DenseIndexRetriever
    from sonar.retrieval.rerank import DenseEncoder, DenseReranker, PassageVectors, vectors_dir
    from sonar.retrieval.tantivy_index import TantivyRetriever

    bm25 = TantivyRetriever(work / "index")
    minilm = DenseEncoder()
    enc = DenseEncoder(stand_in_encoder_dir(work), max_length=128)
    dense = DenseIndexRetriever(PassageVectors(vectors_dir(work / "index", enc.tag)), enc, bm25)
    qs = queries_of(work, cfg["queries"] + cfg["batch"])
    warm, qs = qs[:cfg["batch"]], qs[cfg["batch"]:]
    rq = qs[:cfg["rerank_queries"]]  # distinct queries: every candidate cold, the rerank's worst case
    out: dict = {"queries": len(qs), "rerank_queries": len(rq)}
    for name, make, queries in (("bm25", lambda: bm25, qs), ("dense", lambda: dense, qs),
                                ("rerank", lambda: DenseReranker(bm25, minilm, n=RERANK_N, cache_size=50_000), rq)):
        make().batch_search(warm, K)  # warm the page cache and the encoder
        for c in cfg["clients"]:
            r = make()  # a fresh vector cache per setting
            out[f"{name}/{c}"] = load(r, queries, c, cfg["batch"])
            if name == "rerank":
                st = r.stats()
                out[f"rerank/{c}"].update(encoded_per_query=st["encoded"] / st["queries"],
                                          vector_hit_rate=st["cache_hits"] / max(1, st["encoded"] + st["cache_hits"]))
    # the scan alone (no encoding, no text lookup): the store is read once per batch, so bytes/s
    import numpy as np

    m = dense.vectors.matrix
    qv = enc.encode(warm)
    scans = []
    for _ in range(5):
        t0 = time.perf_counter()
        dense.top_rows(qv, K)
        scans.append(time.perf_counter() - t0)
    out["dense/store_bytes"] = int(m.nbytes)
    out["dense/scan_s"] = float(np.median(scans))
    out["dense/bytes_per_s"] = m.nbytes / out["dense/scan_s"]
    return out


def run_phase(name: str, work: Path, cfg: dict) -> dict:
    """``phase`` in a fresh child process (its own wall time and peak RSS); the child's JSON, or, when it was
    killed (``dense-kill``), its exit status and the store's state it left."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "sonar.bench.corpus_scale", "--phase", name, "--work", str(work),
                        "--cfg", json.dumps(cfg)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if name == "dense-kill":
        from sonar.retrieval.rerank import _read_meta, vectors_dir

        meta = _read_meta(vectors_dir(work / "index", "stand-in-encoder"))
        return {"returncode": p.returncode, "process_s": wall, "rows_done": meta["rows_done"],
                "status": meta["status"], "shards": len(meta["shards"])}
    if p.returncode != 0:
        raise RuntimeError(f"phase {name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


# --------------------------------------------------------------------------------------- projection
def projection(res: dict, n: int = WIKI18_PASSAGES) -> dict:
    """The measured rates carried to ``n`` passages (see the module docstring for each assumption)."""
    P = res["config"]["passages"]
    bm25_rate = res["bm25"]["docs"] / res["bm25"]["wall_s"]
    mini = res["minilm"]
    flop_per_passage = 2 * MINILM_PARAMS * mini["mean_tokens"]
    gpu_rate = ASSUMED_MFU * H100_BF16_FLOPS / flop_per_passage
    store = n * 384 * 2
    return {
        "passages": n,
        "bm25_index_h_here": n / bm25_rate / 3600,
        "bm25_index_bytes": res["bm25"]["index_bytes"] * n / P,
        "minilm_encode_days_here": n / mini["passages_per_s"] / 86400,
        "minilm_passages_per_s_h100": gpu_rate,
        "minilm_encode_min_8xh100": n / (8 * gpu_rate) / 60,
        "minilm_store_bytes": store,
        "e5_base_store_bytes": n * 768 * 2,
        "dense_exact_batch_s_here": store / res["serve"]["dense/bytes_per_s"],
        "dense_scan_gb_per_s_here": res["serve"]["dense/bytes_per_s"] / 1e9,
        "dense_exact_batch_ms_h100": 1e3 * store / H100_HBM_BYTES_S,
        "rerank_ms_per_query_here": 1e3 / res["serve"][f"rerank/{res['config']['clients'][0]}"]["qps"],
        "rerank_ms_per_query_h100": 1e3 * RERANK_N * flop_per_passage / (ASSUMED_MFU * H100_BF16_FLOPS),
        "formulas": {
            "bm25_index_h_here": "n / (docs / bm25 wall_s) (this machine, tantivy)",
            "minilm_passages_per_s_h100": f"{ASSUMED_MFU} x {H100_BF16_FLOPS:.3g} / (2 x {MINILM_PARAMS:.3g} x mean tokens)",
            "minilm_encode_min_8xh100": "n / (8 x the above) / 60",
            "minilm_store_bytes": "n x 384 x 2 (float16)",
            "dense_exact_batch_s_here": "store bytes / (this machine's bytes/s scanning the stand-in store, "
                                        "float16 to float32 and the product included)",
            "dense_exact_batch_ms_h100": f"store bytes / {H100_HBM_BYTES_S:.3g} B/s",
            "rerank_ms_per_query_here": "1 / (BM25 + rerank queries/s at one client, cold cache): independent of "
                                        "the corpus size",
            "rerank_ms_per_query_h100": f"{RERANK_N} candidates x 2 x {MINILM_PARAMS:.3g} x mean tokens / "
                                        f"({ASSUMED_MFU} x {H100_BF16_FLOPS:.3g})",
        }}


# --------------------------------------------------------------------------------------------- main
def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's corpus-scale block: build, start-up, serving, and the 21 M projection."""
    e, c = doc["extra"], doc["config"]
    b, sn, sd, mk, mr, pr = e["bm25"], e["startup-none"], e["startup-dense"], e["dense-kill"], e["dense-resume"], \
        e["projection"]
    lines = [f"{c['passages']:,} synthetic passages on this machine (one child process per phase):", "",
             "| phase | wall | peak RSS | what it did |", "|---|---|---|---|",
             f"| BM25 index (`sonar index`) | {b['wall_s']:.0f} s | {b['peak_rss_mb']:,.0f} MB | "
             f"{b['docs']:,} documents, {b['docs'] / b['wall_s']:,.0f}/s, {b['index_bytes'] / 1e9:.2f} GB on disk |",
             f"| start-up, `rerank=none` | {sn['ready_s']:.2f} s | {sn['peak_rss_mb']:,.0f} MB | index opened, ready to "
             f"search (first batch {sn['first_batch_s']:.2f} s) |",
             f"| start-up, `rerank=dense` | {sd['ready_s']:.2f} s | {sd['peak_rss_mb']:,.0f} MB | index and MiniLM "
             f"ready, nothing encoded (first batch {sd['first_batch_s']:.2f} s: {sd['encoded']} candidates encoded) |",
             f"| MiniLM passage encoding | {e['minilm']['seconds']:.1f} s | {e['minilm']['peak_rss_mb']:,.0f} MB | "
             f"{e['minilm']['passages']:,} passages, {e['minilm']['passages_per_s']:.1f}/s on "
             f"{e['minilm']['threads']} threads |",
             f"| `sonar index --dense`, killed halfway (stand-in encoder) | {mk['process_s']:.0f} s | | exit "
             f"{mk['returncode']}, {mk['rows_done']:,} rows in {mk['shards']} finished shards |",
             f"| ... run again | {mr['wall_s']:.0f} s | {mr['peak_rss_mb']:,.0f} MB | encoded {mr['encoded']:,} "
             f"(the rest), {mr['vectors']:,} vectors |", "",
             f"Serving (batches of {c['batch']} queries from client threads; queries/s, per-batch p50 / p99 ms):", "",
             "| backend | " + " | ".join(f"{k} client{'s' if k > 1 else ''}" for k in c["clients"]) + " |",
             "|---|" + "---|" * len(c["clients"])]
    sv = e["serve"]
    for name, label in (("bm25", "BM25 (tantivy)"), ("rerank", f"BM25 top-{RERANK_N} + MiniLM rerank at query time"),
                        ("dense", "dense backend, exact (stand-in vectors)")):
        cells = [f"{sv[f'{name}/{k}']['qps']:,.0f} ({sv[f'{name}/{k}']['batch_ms_p50']:,.0f} / "
                 f"{sv[f'{name}/{k}']['batch_ms_p99']:,.0f})" for k in c["clients"]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    c1 = sv[f"rerank/{c['clients'][0]}"]
    lines += ["", f"The rerank ran {sv['rerank_queries']} distinct queries per setting with a fresh vector cache (its "
              f"worst case): {c1['encoded_per_query']:.1f} passages encoded per query, cache hit rate "
              f"{c1['vector_hit_rate']:.2f}; the other rows {sv['queries']:,} queries.", "",
              f"Projected to the {pr['passages']:,} passages of the DPR Wikipedia split:", "",
              "| | projection |", "|---|---|",
              f"| BM25 index, this machine | {pr['bm25_index_h_here']:.1f} h, {pr['bm25_index_bytes'] / 1e9:.0f} GB |",
              f"| MiniLM vectors, this machine | {pr['minilm_encode_days_here']:.0f} days |",
              f"| MiniLM vectors, 8 H100 (FLOP estimate at {ASSUMED_MFU:.0%} MFU) | "
              f"{pr['minilm_encode_min_8xh100']:.0f} min ({pr['minilm_passages_per_s_h100']:,.0f} passages/s per GPU) |",
              f"| vector store (float16) | MiniLM {pr['minilm_store_bytes'] / 1e9:.1f} GB, e5-base "
              f"{pr['e5_base_store_bytes'] / 1e9:.1f} GB |",
              f"| exact dense search, one batch | {pr['dense_exact_batch_s_here']:.1f} s here (scanning at "
              f"{pr['dense_scan_gb_per_s_here']:.2f} GB/s), "
              f"{pr['dense_exact_batch_ms_h100']:.1f} ms on one H100 (a full read of the store) |",
              f"| rerank at query time, per query, whatever the corpus size | {pr['rerank_ms_per_query_here']:,.0f} ms "
              f"here (cold cache), {pr['rerank_ms_per_query_h100']:.2f} ms on one H100 (FLOP estimate) |",
              "", f"Measured by `sonar bench corpus-scale` on commit {doc['commit']}."]
    return readme_block(NAME, json_name, lines)


def plot(extra: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = ["bm25", "startup-none", "startup-dense", "minilm", "dense-resume", "serve"]
    ax.bar(names, [extra[n]["peak_rss_mb"] for n in names])
    ax.set_ylabel("peak RSS (MB)")
    ax.set_title("per phase")
    ax.tick_params(axis="x", rotation=30)
    clients = extra["config"]["clients"]
    for name in ("bm25", "rerank", "dense"):
        bx.plot(clients, [extra["serve"][f"{name}/{c}"]["qps"] for c in clients], marker="o", label=name)
    bx.set_xscale("log", base=2)
    bx.set_yscale("log")
    bx.set_xlabel("client threads")
    bx.set_ylabel("queries/s")
    bx.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--phase"]:  # a child: one phase, one JSON line on stdout
        setup_env()
        name, work, cfg = argv[1], Path(argv[3]), json.loads(argv[5])
        print(json.dumps(phase(name, work, cfg)))
        return 0
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--work-dir", default=None, help="where the corpus and its indexes live (default "
                   "runs/bench-corpus-scale[-quick]; the corpus is reused, the indexes rebuilt)")
    p.add_argument("--passages", type=int, default=None, help="override the corpus size")
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.passages:
        cfg["passages"] = args.passages
    work = Path(args.work_dir or REPO_ROOT / "runs" / f"bench-corpus-scale{'-quick' if args.quick else ''}")
    work.mkdir(parents=True, exist_ok=True)
    import shutil

    from sonar.retrieval.corpus import count_records, write_synthetic_corpus

    t0 = time.perf_counter()
    corpus = work / "corpus.jsonl"
    if not corpus.is_file() or count_records(corpus) != cfg["passages"]:
        write_synthetic_corpus(corpus, cfg["passages"], seed=0)
    shutil.rmtree(work / "index", ignore_errors=True)  # every build measured from nothing
    stand_in_encoder_dir(work)
    extra: dict = {"config": cfg}
    for name in ("bm25", "startup-none", "startup-dense", "minilm", "dense-kill", "dense-resume", "serve"):
        print(f"[{NAME}] {name} ...", flush=True)
        extra[name] = run_phase(name, work, cfg)
        print(f"[{NAME}] {name}: {json.dumps(extra[name])[:300]}", flush=True)
    extra["projection"] = projection(extra)
    extra["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    extra["wall_s"] = round(time.perf_counter() - t0, 1)
    metrics = {"bm25_docs_per_s": summarise([extra["bm25"]["docs"] / extra["bm25"]["wall_s"]]),
               "startup_dense_minus_none_s": summarise([extra["startup-dense"]["ready_s"]
                                                        - extra["startup-none"]["ready_s"]]),
               "resume_encoded_share": summarise([extra["dense-resume"]["encoded"] / cfg["passages"]]),
               "minilm_passages_per_s": summarise([extra["minilm"]["passages_per_s"]])}
    path = write_result(NAME, dict(cfg, quick=args.quick), metrics, lambda png: plot(extra, png), args.out,
                        extra=extra)
    print(f"[{NAME}] wrote {path} in {extra['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
