"""The one typed config.

Dataclasses are the schema; YAML files are sparse overrides; the CLI takes ``key=value``.
Load order: ``OmegaConf.structured(Config)`` <- each YAML in order <- CLI dotlist, then
``OmegaConf.to_object`` and :func:`validate`. Unknown keys and wrong types fail in OmegaConf
(re-raised as :class:`ConfigError` naming the key); cross-field checks raise ``ValueError``
naming both fields and their values. After loading, frozen dataclasses travel and each
component receives only its own slice (``cfg.learner``, ``cfg.retrieval``...).

Pure module: imports only the standard library and omegaconf (and, for a run on GPUs, the memory
plan's torch and transformers: ``_check_memory``).
"""
from __future__ import annotations

import contextvars
import copy
import dataclasses
import json
import math
import re
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sonar.cluster.wire import plugins as _plugins
from sonar.cluster.wire.algos import spec_of
from sonar.cluster.wire.paths import CONFIG_DIR, find_config, resolve_relative, resolve_run_root
from sonar.cluster.wire.resolved import broadcast_backend, engine_dtype, vllm_batched_tokens  # noqa: F401  (re-exported: callers import them from here)

DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"


class ConfigError(ValueError):
    """A config that cannot be loaded: unknown key, wrong type or impossible combination."""


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric field (of each element, for a list of numbers): ``lo`` to ``hi``,
    each bound inclusive unless ``*_open``; an infinite bound is no bound. Declared once, beside its
    field (:func:`ranged`); ``_check_ranges`` refuses a value outside it at load, and ``str`` is how the
    refusal says it: ``>= 1``, ``> 0``, ``<= 0`` or an interval ``(0, 1]``."""

    lo: float = -math.inf
    """Lower bound (-inf: none)."""
    hi: float = math.inf
    """Upper bound (inf: none)."""
    lo_open: bool = False
    """The lower bound itself is refused (``> lo``)."""
    hi_open: bool = False
    """The upper bound itself is refused (``< hi``)."""

    def __post_init__(self):
        if not (self.lo < self.hi and (math.isfinite(self.lo) or math.isfinite(self.hi))):
            raise ValueError(f"Range(lo={self.lo}, hi={self.hi}): need lo < hi and at least one finite bound")

    @property
    def is_interval(self) -> bool:
        """Both bounds finite (printed ``[a, b]``, and said "in [a, b]")."""
        return math.isfinite(self.lo) and math.isfinite(self.hi)

    def __contains__(self, v: float) -> bool:
        return (v > self.lo if self.lo_open else v >= self.lo) and (v < self.hi if self.hi_open else v <= self.hi)

    def __str__(self) -> str:
        if not math.isfinite(self.hi):
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if not math.isfinite(self.lo):
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def ranged(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
           ge: Optional[float] = None, gt: Optional[float] = None,
           le: Optional[float] = None, lt: Optional[float] = None) -> Any:
    """A numeric field with its valid range (``ge``/``gt`` the lower bound, ``le``/``lt`` the upper), kept
    in the field's metadata: the one place the range is written. OmegaConf ignores the metadata; the
    default and ``default_factory`` are a plain ``dataclasses.field``'s."""
    if ge is not None and gt is not None or le is not None and lt is not None:
        raise TypeError("ranged(): give at most one of ge/gt and one of le/lt")
    lo, hi = ge if ge is not None else gt, le if le is not None else lt
    rng = Range(lo=-math.inf if lo is None else float(lo), hi=math.inf if hi is None else float(hi),
                lo_open=gt is not None, hi_open=lt is not None)
    return field(default=default, default_factory=default_factory, metadata={"range": rng})


@dataclass(frozen=True)
class WorldConfig:
    """The embedded synthetic world: entities, one passage each, 1- and 2-hop questions."""

    seed: int = ranged(0, ge=0)
    """World seed; the corpus, questions and the train/held-out split are a function of it."""
    num_entities: int = ranged(520, ge=18)  # 18: actors/world.py:_MIN_PER_KIND summed (a test keeps them equal)
    """Entities (persons, companies, cities, countries) with made-up names."""
    heldout_fraction: float = ranged(0.15, gt=0, lt=1)
    """Fraction of *entities* whose questions are held out (split by entity, so no fact leaks)."""
    num_heldout_eval: int = ranged(200, ge=0)
    """Held-out questions used by the before/after evaluation (0 = all)."""
    parallel_share: Optional[float] = ranged(None, ge=0, lt=1)
    """Share of parallel questions (two entities looked up in one step, e.g. "were a and b born in the
    same city ?") in the training and in the held-out questions, in [0, 1). None: today's world (about
    3 % held-out, limited by the scarce "yes" pairs). Set, the world adds parallel types and, where
    "yes" pairs run out, drops sequential questions, keeping yes/no balanced per type
    (``actors/world.py:_share_parallel``). HotpotQA's dev set is 20 % comparison questions
    (``sonar bench multi-query`` uses that). Read by ``actors/world.py:build_world``."""
    force: bool = False
    """Train RL stages (and evaluate) on this world's toy questions even though ``model.path`` names a
    pretrained model (a vocabulary of >= ``REAL_VOCAB`` tokens, or a Hub id) or ``retrieval.corpus`` a real
    corpus. False refuses that at load: it is almost always a preset missing ``stages.N.data`` /
    ``eval.data`` (the world's questions cannot be answered from a real corpus, and a pretrained model
    learns nothing from "in which country is the city kruk du ?")."""


@dataclass(frozen=True)
class ModelConfig:
    """The policy. ``path`` set: a local Hugging Face directory; unset: a tiny random model."""

    path: Optional[str] = None
    """Local HF model directory (weights + tokenizer), or a Hub id ``org/name`` that is not a local path
    (fetched by ``actors/model.py:resolve_model_path``; only from the cache when HF_HUB_OFFLINE is set).
    None builds the tiny model below."""
    hidden_size: int = ranged(128, ge=1)
    """Tiny model only (ignored when ``path`` is set): hidden width, divisible by ``num_heads``.
    Read by ``actors/model.py:build_policy``, as are the fields below."""
    num_layers: int = ranged(2, ge=1)
    """Tiny model only: decoder layers (>= 1)."""
    num_heads: int = ranged(4, ge=1)
    """Tiny model only: attention heads, also the key/value heads (no grouped-query attention)."""
    intermediate_size: int = ranged(384, ge=1)
    """Tiny model only: width of the SwiGLU MLP (>= 1)."""
    max_position_embeddings: int = ranged(1024, ge=1)
    """Tiny model only: the longest sequence in tokens; must be >= ``protocol.max_total_tokens``."""
    tie_word_embeddings: bool = True
    """Tiny model only: the output head shares the input embedding matrix (one tensor on the wire)."""
    seed: int = ranged(0, ge=0)
    """Init seed of the random model (identical on every process that builds it)."""
    tags: str = "auto"
    """How the protocol tags (``<search>``, ``</answer>``...) reach the policy: text | special | auto.
    text: plain text, as upstream R1-Searcher / Search-R1 / RAG-R1 keep them: the tokenizer and the
    embeddings are used as they are, the tags tokenise as ordinary text and a turn stops on the tag
    strings (needs ``path``: the tiny word tokenizer has the tags in its own vocabulary). special: each
    tag one added special token, the embedding grown (never shrunk into a padded vocabulary's rows) and
    the new rows set to the mean of the trained ones (``actors/model.py:add_tags_to_policy``); a turn
    stops on the tag ids. auto: text when ``path`` is set, special for the tiny model
    (``model_tags``)."""


def model_tags(m: "ModelConfig") -> str:
    """Resolved ``model.tags``: the explicit value, else text for a ``path`` (a stock tokenizer) and
    special for the tiny word-level model."""
    if m.tags != "auto":
        return m.tags
    return "text" if m.path else "special"


@dataclass(frozen=True)
class ProtocolConfig:
    """Tool protocol: which tags delimit queries, documents and the answer."""

    name: str = "rag_r1_multi"
    """The tag set: r1_searcher | search_r1 | rag_r1 (RAG-R1 single-query, Search-R1's tags) |
    rag_r1_multi (RAG-R1 multi-query: comma-separated queries in one ``<search>``). Read by
    ``actors.prompts.get_protocol`` in the rollout workers, the driver's demonstrations and ``sonar eval``."""
    template: str = "base"
    """base (the prompt as plain text) | chat (the prompt through the tokenizer's chat template, for
    instruct models). Read by ``actors.prompts.render_prompt``."""
    prompt: str = "short"
    """The prompt text and documents format (``actors/prompts.py``): short (``question : ...``, Sonar's
    compact documents block; for the tiny model, which learns the format by SFT) | r1_searcher_eval
    (R1-Searcher's evaluation prompt, ``evaluation/eval_search_loacl.py``; template base) | r1_searcher_base
    (template base) | r1_searcher_instruct (template chat) | search_r1 | rag_r1 (single- or multi-query
    by ``name``): each paper's prompt and documents block as its released code renders them."""
    rules: str = "sonar"
    """How a turn is cut and parsed and how the answer is read: sonar (``actors/parsing.py``: every turn
    stops at the first closing tag, the first complete block decides, nested or model-written document
    tags and empty answers or queries are invalid actions) | upstream (the paper's released code, per
    protocol, ``actors/upstream.py``): R1-Searcher generates until ``<|end_of_query|>``, EOS or the turn
    limit (no stop at ``</answer>``, so text after the answer stays in the scored response), takes the
    text after the last query opener with double quotes removed, and its answer is the last
    ``<answer>`` of the response; Search-R1 and RAG-R1 take the first ``<search>``/``<answer>`` block
    as the action whatever it contains (an empty answer ends the rollout, an empty search is sent), and
    RAG-R1 searches every comma-separated query up to ``max_queries_per_step``. The paper recipes use
    upstream."""
    on_invalid: str = "message"
    """What follows an invalid action (no parseable search or answer): message (Search-R1's / RAG-R1's
    "My previous action is invalid..." is injected as an untrained segment and the rollout continues;
    the turn counts against ``max_turns``) | end (the trajectory ends, finish reason malformed, as
    R1-Searcher does). Read by the rollout loop."""
    max_turns: int = ranged(4, ge=0)
    """Search steps allowed before the answer (R1-Searcher allows 8, RAG-R1 5); invalid actions answered
    with a message count too."""
    max_queries_per_step: int = ranged(3, ge=1)
    """Per-step query budget (RAG-R1 multi-query); extra queries are dropped and counted."""
    docs_per_query: int = ranged(1, ge=1)
    """Documents injected per query (R1-Searcher's default is 3)."""
    max_new_tokens_per_turn: int = ranged(48, ge=1)
    """Tokens the policy may generate in one turn (>= 1); each row is also capped by what is left of
    ``max_total_tokens``. Read by the rollout loop (``actors/rollout.py``)."""
    max_total_tokens: int = ranged(512, ge=1)
    """Budget for the whole trajectory, prompt and documents included."""
    max_doc_tokens: int = ranged(96, ge=1)
    """Each injected document is truncated to this many tokens."""
    tools: List[str] = field(default_factory=lambda: ["search"])
    """The tools a trajectory may call (``actors/tools.py``): search (the protocol's own query tags, batched
    across trajectories, ``max_turns`` its budget) | visit (``<visit>`` id or title ``</visit>``: opens one
    document of the corpus in full, up to ``visit_max_tokens``, as ASearcher's page visits; its own budget
    ``visit_max_calls``; reward-neutral: visits are not searches for any reward) | a plug-in
    ``module:attr`` / ``file.py:attr``, a ``make(config) -> Tool`` (``cluster/wire/plugins.py``). search
    must be listed (the papers' protocols are search protocols); the papers' presets list only it, so
    their prompts and rendered text are unchanged."""
    visit_max_calls: int = ranged(2, ge=1)
    """Visits one trajectory may make (>= 1, with ``visit`` in ``tools``); a visit past it ends the
    trajectory with finish reason max_turns, as a search past ``max_turns`` does."""
    visit_max_tokens: int = ranged(160, ge=1)
    """A visited document is truncated to this many tokens (>= 1)."""
    tool_options: Dict[str, Any] = field(default_factory=dict)
    """Free-form settings of plug-in tools, by tool name (``tool_options.<name>.<key>``); a tool's
    ``make(config)`` reads its own entry. Sonar's built-in tools read none."""


@dataclass(frozen=True)
class ElasticConfig:
    """Connection to an Elasticsearch cluster. Credentials come from the environment only."""

    hosts: List[str] = field(default_factory=lambda: ["http://127.0.0.1:9200"])
    """Node URLs. A URL with ``user:password@`` is refused: credentials come from the env vars below."""
    index: str = "sonar"
    """Index name; when it does not exist it is created (mapping, BM25 settings) and filled from the run's
    corpus."""
    api_key_env: str = "SONAR_ES_API_KEY"
    """Name of the env var holding the API key (the key itself never enters the config)."""
    username_env: str = "SONAR_ES_USERNAME"
    """Name of the env var holding the basic-auth user (used when the API-key variable is unset)."""
    password_env: str = "SONAR_ES_PASSWORD"
    """Name of the env var holding the basic-auth password."""
    ca_certs: Optional[str] = None
    """CA bundle file for https hosts; None: the system's certificate store."""
    verify_certs: bool = True
    """Verify the server's TLS certificate (turn off only for a local test cluster)."""
    request_timeout_s: float = ranged(10.0, gt=0)
    """Client timeout of one HTTP request, in seconds (> 0). ``retrieval.timeout_s`` bounds a whole
    search call through the service, retries included."""
    bm25_k1: float = ranged(1.2, ge=0)
    """BM25 term-frequency saturation (>= 0), set in the index's similarity when it is created."""
    bm25_b: float = ranged(0.75, ge=0, le=1)
    """BM25 length normalisation in [0, 1], set in the index's similarity when it is created."""
    title_boost: float = ranged(2.0, gt=0)
    """Weight of a title match relative to a text match (> 0). Read by both backends: the
    Elasticsearch ``multi_match`` and the tantivy query (``retrieval/factory.py``)."""
    store_vectors: bool = False
    """With ``retrieval.rerank=dense``: ``sonar index`` stores the MiniLM passage vectors in the index as a
    ``dense_vector`` field and the search path reranks server-side (a ``script_score`` rescore of the BM25
    top ``rerank_candidates``); no client-side vectors of the whole corpus are computed or loaded."""
    shards: int = ranged(1, ge=1)
    """``number_of_shards`` of an index Sonar creates (>= 1); an existing index keeps its own."""
    replicas: int = ranged(0, ge=0)
    """``number_of_replicas`` of an index Sonar creates (>= 0); 0 suits a one-node cluster."""
    cloud_id: Optional[str] = None
    """Elastic Cloud deployment id; when set it replaces ``hosts`` (authenticate with the API key or the
    user/password env vars above; their values are never logged)."""
    bulk_batch_size: int = ranged(500, ge=1)
    """Documents per bulk request of ``sonar index`` (>= 1); the resume point is recorded after each."""


@dataclass(frozen=True)
class HttpRetrievalConfig:
    """A retrieval server over HTTP (``retrieval.backend=http``), Search-R1's ``/retrieve`` API
    (``retrieval/http_backend.py``). Credentials come from the environment only."""

    url: str = "http://127.0.0.1:8000/retrieve"
    """The endpoint (http or https; ``user:password@`` in it is refused: use ``token_env``). Search-R1's
    ``retrieval_server.py`` listens on port 8000 and its training scripts point at this URL."""
    timeout_s: float = ranged(10.0, gt=0)
    """Client timeout of one HTTP request, in seconds (> 0); ``retrieval.timeout_s`` bounds a whole
    search call through the service, retries included."""
    max_batch: int = ranged(64, ge=1)
    """Queries per request at most (>= 1); a larger call is split into several requests, in order."""
    token_env: Optional[str] = None
    """Name of the env var holding a bearer token sent as ``Authorization: Bearer``; None: no header."""
    return_scores: bool = True
    """Ask for scores (``{"document", "score"}`` hits, as Search-R1's own client does); false: the server
    answers bare documents, every hit scores 0.0. Either way the hits keep the server's order."""
    max_response_mb: float = ranged(64.0, gt=0)
    """An answer larger than this (MiB) is refused as a failed search (a server that streams without end, or
    whole web pages in every hit, cannot fill the worker's memory); 64 answers of 10 hits of 100 KB fit."""


@dataclass(frozen=True)
class DenseIndexConfig:
    """The dense index (``retrieval.backend=dense``; ``sonar index --dense`` builds it for any backend): one
    L2-normalised vector per passage beside the BM25 index, searched exactly by inner product
    (``retrieval/dense_index.py``), Search-R1's e5 + flat FAISS retriever as a config choice."""

    model: Optional[str] = None
    """Encoder directory (mean-pooled, e.g. e5-base-v2 or all-MiniLM-L6-v2); None: the packaged MiniLM."""
    query_prefix: str = ""
    """Prepended to each query before encoding (e5: ``"query: "``)."""
    passage_prefix: str = ""
    """Prepended to each passage before encoding (e5: ``"passage: "``); part of the vectors' identity: a
    store built with another prefix is rebuilt."""
    shard_rows: int = ranged(4096, ge=1)
    """Passages per resumable shard of the build: a build killed part-way keeps its finished shards."""
    build_workers: int = ranged(0, ge=0)
    """Ray actors that encode the shards of ``sonar index --dense`` side by side, each on a GPU when the cluster
    has them (``cluster.address`` / ``RAY_ADDRESS``, else a local Ray); 0: in the ``sonar index`` process."""
    search_block_rows: int = ranged(262_144, ge=1)
    """Vectors scored per matrix product at search time (bounds the float32 copy: rows x dim x 4 bytes)."""


@dataclass(frozen=True)
class RetrievalConfig:
    """Search backend, reranker, cache and the shared service."""

    backend: str = "tantivy"
    """tantivy (embedded BM25) | elasticsearch | http (a retrieval server with Search-R1's ``/retrieve`` API,
    ``retrieval.http``) | dense (exact inner product over the vectors ``sonar index --dense`` built,
    ``retrieval.dense``) | a plug-in ``module:attr`` / ``file.py:attr``: ``make(config, corpus, index_root)
    -> Retriever`` (``cluster/wire/plugins.py``). Read by ``retrieval/factory.py``."""
    corpus: Optional[str] = None
    """JSONL corpus {id, title, text}; None uses the synthetic world's corpus."""
    index_dir: Optional[str] = None
    """Where the tantivy index (and passage vectors) live; None: <run.root>/index/<corpus hash>."""
    k: int = ranged(1, ge=1)
    """Hits requested per query (>= ``protocol.docs_per_query``; the extra hits replace documents that
    another query of the same step already returned). Read by the rollout worker and ``sonar eval``."""
    rerank: str = "none"
    """none | dense | cross"""
    rerank_candidates: int = ranged(20, ge=1)
    """First-stage depth N for reranking (top-N BM25, then top-k dense)."""
    rerank_model: Optional[str] = None
    """Encoder directory for dense/cross rerank; None uses the packaged MiniLM."""
    rerank_cache: int = ranged(50_000, ge=0)
    """Passage vectors the dense reranker keeps (LRU, float16: 50,000 MiniLM rows are 38 MB per replica); it
    encodes only the candidates it reranks, at query time, so a passage seen again costs nothing."""
    cache_size: int = ranged(4096, ge=0)
    """LRU entries; 0 disables the cache."""
    max_query_chars: int = ranged(512, ge=1)
    """Longer queries are truncated (counted in retrieval/truncated)."""
    timeout_s: float = ranged(10.0, gt=0)
    """Bound on one search call through the retrieval service, in seconds (> 0); on expiry the turn's
    searches fail with error ``timeout`` (data, not a crash). Read by the rollout workers' client;
    held-out evaluation waits up to ``cluster.step_timeout_s`` instead (a measurement must not depend
    on load), and SFT demonstrations are searched in process, without the service."""
    max_retries: int = ranged(2, ge=0)
    """Elasticsearch only: retries of a call that failed with a retryable error (timeout, 5xx, 429,
    connection) in ``ResilientRetriever``; 0 disables. The in-process tantivy backend is not wrapped."""
    backoff_s: float = ranged(0.1, ge=0)
    """Elasticsearch only: delay before the first retry, in seconds (>= 0); it doubles per retry, is
    capped at 2 s and jittered."""
    breaker_failures: int = ranged(5, ge=1)
    """Consecutive failures that open the circuit breaker."""
    breaker_reset_s: float = ranged(5.0, ge=0)
    """Elasticsearch only: seconds an open breaker fails calls at once before one probe call may try."""
    replicas: int = ranged(1, ge=1)
    """RetrievalServer Ray actors shared by all rollout workers (>= 1); each worker's client sends a call
    to the least-loaded healthy replica. The driver starts them (``cluster/driver/roles.py``)."""
    num_cpus_per_replica: float = ranged(1.0, ge=0)
    """Ray CPUs each retrieval replica asks for (>= 0): what its batching thread, the BM25 index (or the
    Elasticsearch client) and a CPU reranker use. Counted by the local cluster's CPU total and by the
    autoscaler, which adds a CPU node for replicas that do not fit (``cluster/clusters/``); 0 places
    them anywhere without taking a CPU slot."""
    batch_window_ms: float = ranged(2.0, ge=0)
    """Service micro-batching: how long a replica collects requests after the oldest one arrived before
    it calls the backend, in ms (>= 0; 0: send what is queued at once)."""
    max_batch: int = ranged(64, ge=1)
    """Service micro-batching: queries merged into one backend call at most (>= 1); a larger request is
    sent alone, never split."""
    max_concurrency: int = ranged(16, ge=1)
    """Backend calls a replica keeps in flight at most (>= 1; its thread pool's size). While every slot is
    busy, queued requests keep merging, so batches grow with load."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Connection and index settings, read when ``backend`` is elasticsearch (``title_boost``: always)."""
    http: HttpRetrievalConfig = field(default_factory=HttpRetrievalConfig)
    """The retrieval server, read when ``backend`` is http."""
    dense: DenseIndexConfig = field(default_factory=DenseIndexConfig)
    """The dense index, read by ``backend=dense`` and ``sonar index --dense``."""


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout workers and sampling."""

    num_workers: int = ranged(2, ge=1)
    """Rollout worker actors (>= 1), each holding its own engine copy of the policy (driver roles)."""
    group_size: int = ranged(8, ge=1)
    """Samples per prompt (a GRPO group)."""
    groups_per_request: int = ranged(2, ge=1)
    """Groups a worker generates together in one batched pass."""
    batches_in_flight: int = ranged(1, ge=1)
    """Batches a worker keeps going at once: while one waits on retrieval, another generates."""
    temperature: float = ranged(1.0, ge=0)
    """Sampling temperature of training rollouts (>= 0; > 0 for an RL stage). The learner divides its
    logits by the same value, so its logprobs are comparable with the recorded ones. Evaluation is greedy."""
    top_p: float = ranged(1.0, gt=0, le=1)
    """Nucleus sampling of training rollouts, in (0, 1]: per row and step, the sampler keeps the most
    likely tokens until their probability under ``softmax(logits / temperature)`` reaches ``top_p``
    (the token that crosses it included) and draws from that set renormalised. The *recorded* logprob
    is still ``log_softmax(logits / temperature)`` of the drawn token over the full vocabulary, which is
    what the learner recomputes: it is not the sampler's own probability, which is higher by
    ``-log(nucleus mass)``. So with top_p < 1 the importance weights cannot see the truncation, and the
    policy gradient is biased toward it; 1 (default) samples the full distribution and the recorded
    logprob is exactly the behaviour policy's. Read by the engines (via the rollout loop). The vllm
    engine differs with top_p < 1: vLLM records the truncated sampler's own logprob (renormalised over
    the nucleus), not the full-vocabulary one; with top_p = 1 the two are the same number."""
    engine: str = "hf"
    """hf (transformers, CPU/GPU) | vllm (vLLM's async engine, CPU or GPU: actors/engine_vllm.py);
    actors/engines.py builds it. On CPU hf is faster for the tiny policy (bench/README.md, engines)."""
    continuous_batching: bool = False
    """hf engine: concurrent generate calls of a worker's lanes share decode steps, rows join and leave
    the running batch every step, weights swap between steps (actors/engine_continuous.py)."""
    max_batch_rows: int = ranged(64, ge=1)
    """Rows an engine decodes together at most (a continuous engine's live rows)."""
    per_trajectory: bool = False
    """How a batch's trajectories take their turns (actors/rollout.py). False: in lockstep, one batched
    generate per turn over every active row, then one batched search; a row waits for the batch's
    slowest turn before it searches. True: every trajectory is its own coroutine (veRL's agent loop),
    one engine call and one search per turn of its own, so no row waits for another's turn; needs an
    engine that batches concurrent calls (``continuous_batching`` or the vllm engine)."""
    num_cpus_per_worker: float = ranged(1.0, ge=0)
    """Ray CPUs reserved per rollout worker (placement; torch runs one thread per worker)."""
    num_gpus_per_worker: float = ranged(0.0, ge=0)
    """Ray GPUs reserved per rollout worker (placement; the vLLM engine runs on the GPU Ray assigns)."""
    sleep_level: int = ranged(1, ge=1, le=2)
    """``cluster.placement=colocated``: how far an engine sleeps while the learner trains on its GPU (vLLM's
    sleep mode, ``enable_sleep_mode``). 1: its weights are offloaded to host memory and its KV cache is
    dropped (the wake-up copies the weights back, then the push overwrites them); 2: its weights are dropped
    too (no host copy: the push after every step brings them back). The HF engine moves its model to host
    memory at either level. On CPU there is no device memory to release, so a sleep marks the engine asleep
    (it refuses to generate) and frees nothing (``actors/worker.py``)."""
    weight_update: str = "auto"
    """vllm engine: how a weight push lands while rows are being generated. auto (resolved at load):
    interrupt in async mode, where rows are always in flight when a push comes and partial rollouts pay
    (no push waits for the longest row), pause in sync mode (no row is in flight at a push). pause: no new rows start,
    the rows in flight finish under the old weights, then the load (no row mixes two versions);
    interrupt: the rows in flight are aborted, the weights load, and each row resumes from its prefix
    under the new weights (AReaL's interruptible rollout: no waiting, and the row's MODEL segment
    records both versions' token ranges, ``Generation.version_spans``). The push streams its buckets
    straight into the model (two bucket buffers, no staged copy), so under pause the learner's push waits
    for the rows in flight to finish (reported as ``wait_s``, not as transfer time) and
    ``cluster.step_timeout_s`` must cover that drain; interrupt waits for nothing. Read by actors/engine_vllm.py."""
    tensor_parallel_size: int = ranged(1, ge=1)
    """vllm engine: GPUs one engine shards the policy over (>= 1); each shard is a rank of the weight
    broadcast. > 1 needs rollout.num_gpus_per_worker >= it (whole GPUs)."""
    vllm_dtype: str = "auto"
    """vllm engine: auto | float32 | bfloat16 | float16, the dtype vLLM computes in. auto is the learner's
    precision (bfloat16 when learner.precision is bf16, or auto with learner.num_gpus > 0; float32
    otherwise: ``engine_dtype``), because sampling logprobs match the learner's recomputation only in the
    learner's precision. (vLLM's own "auto" would run a float32 checkpoint in bfloat16 on CPU.)"""
    vllm_kv_cache_gib: float = ranged(1.0, ge=0)
    """vllm engine: KV-cache size per engine, in GiB (>= 0; RAM on CPU, GPU memory on GPU). 0: vLLM sizes
    it from rollout.vllm_gpu_memory_utilization -- on CPU that fraction of the whole node's RAM."""
    vllm_gpu_memory_utilization: float = ranged(0.9, gt=0, le=1)
    """vllm engine, with rollout.vllm_kv_cache_gib=0: fraction of the device's memory (in (0, 1]) vLLM
    takes for weights and KV cache. Leave room for one more copy of the weights: the buffers the
    broadcast is received into live beside the model."""
    vllm_enable_prefix_caching: bool = True
    """vllm engine: reuse the KV blocks of a shared token prefix (each turn of a trajectory resends the
    whole prefix, and a group's rows share their prompt). Reset at every weight load."""
    vllm_max_num_batched_tokens: int = ranged(0, ge=0)
    """vllm engine: tokens one engine step may process (vLLM's ``max_num_batched_tokens``, >= 0). 0: derived
    (``resolved.vllm_batched_tokens``): on GPU every running row's decode token plus one whole prefill of
    the longest context, ``rollout.max_batch_rows + protocol.max_total_tokens`` (vLLM's own default, 2,048
    tokens, would let at most 2,048 of the rows decode per step and split every longer prompt); on CPU, where
    chunked prefill is off, ``max(protocol.max_total_tokens, 4096)`` (a prefill must fit one step). Set by
    hand, it is refused below what every row's decode token (GPU) or the longest prefill (CPU) needs."""
    vllm_enforce_eager: bool = True
    """vllm engine: no torch.compile / CUDA graphs. True on CPU (compilation costs minutes there and
    gains little for small models); set False on GPU, where CUDA graphs speed up decoding."""
    min_workers: Optional[int] = ranged(None, ge=1)
    """Elastic pool: the fewest rollout workers the driver shrinks to (>= 1; None: ``num_workers``).
    The pool starts at ``num_workers``; with min_workers < max_workers the driver's pool controller
    (``cluster/driver/pool.py``) resizes it at learner-step boundaries (async mode only)."""
    max_workers: Optional[int] = ranged(None, ge=1)
    """Elastic pool: the most rollout workers the driver grows to (>= num_workers; None: ``num_workers``,
    a fixed pool). The driver asks the Ray autoscaler for the bundles of this target
    (``ray.autoscaler.sdk.request_resources``) before it starts a worker."""
    pool_window_s: float = ranged(30.0, gt=0)
    """Elastic pool: seconds of learner steps the controller looks back over before a decision (> 0)."""
    pool_grow_wait_share: float = ranged(0.3, gt=0, le=1)
    """Elastic pool: add a worker when the learner spent more than this share of the window waiting for
    groups (``learner/wait_s`` over wall time), in (0, 1]."""
    pool_shrink_full_share: float = ranged(0.8, gt=0, le=1)
    """Elastic pool: remove a worker when the replay was full at more than this share of the window's
    learner steps, in (0, 1]. Full: depth >= ``replay.capacity_groups`` - ``learner.groups_per_step``
    right after the learner took its batch (blocked producers refill it at once)."""
    pool_cooldown_s: float = ranged(30.0, ge=0)
    """Elastic pool: seconds after a resize before the next decision (>= 0); the window restarts too."""


@dataclass(frozen=True)
class AlgoConfig:
    """Policy-gradient algorithm and off-policy correction."""

    name: str = "grpo"
    """grpo | dr_grpo | reinforce_pp | reinforce_pp_baseline | group_norm | ppo. ``reinforce_pp_baseline`` is
    OpenRLHF's ``reinforce_baseline`` (R1-Searcher): the group mean is subtracted from the outcome, then the
    per-token returns are whitened over the batch; ``reinforce_pp`` whitens without the group baseline;
    ``group_norm`` is OpenRLHF's ``group_norm`` (R1-Searcher's Llama stage 1): (r - group mean) / (unbiased
    group std + 1e-9), per-token returns, no batch whitening. Or a plug-in ``module:attr`` / ``file.py:attr``:
    an estimator carrying its ``AlgoSpec`` (``cluster/wire/algos.py``; learner/README.md)."""
    std_normalize: Optional[bool] = None
    """grpo / ppo: divide the group-centred rewards by the unbiased group std + 1e-6 (TRL, veRL). None: the
    algorithm's default (True for grpo and ppo, False for dr_grpo); True with dr_grpo or a REINFORCE++ variant
    is refused (Dr.GRPO never divides; REINFORCE++ whitens over the batch, group_norm always divides)."""
    clip_low: float = ranged(0.2, ge=0, lt=1)
    """Lower PPO clip: the ratio's lower bound is 1 - clip_low, clip_low in [0, 1)."""
    clip_high: float = ranged(0.28, ge=0)
    """Asymmetric PPO clip: ratio in [1-clip_low, 1+clip_high] (clip-higher)."""
    dual_clip: Optional[float] = ranged(None, gt=1)
    """Dual-clip PPO (Ye et al. 2020; veRL's ``clip_ratio_c``, 3.0 there), > 1: for a negative advantage
    the token's loss is at most -A * dual_clip, so a ratio above dual_clip gives no gradient (a token
    the policy now favours far more than the behaviour did cannot be pushed down without bound).
    None: off (the plain PPO clip)."""
    loss_agg: Optional[str] = None
    """token_mean | seq_mean_token_mean | seq_sum_norm (sum / loss_norm_const). None: the algorithm's default,
    seq_sum_norm for dr_grpo (its constant normaliser is half of Dr.GRPO), token_mean for the others. An
    explicit value is honoured for every algorithm (e.g. to ablate Dr.GRPO's aggregation)."""
    loss_norm_const: float = ranged(512.0, gt=0)
    """seq_sum_norm only: the constant (in tokens, > 0) a sequence's summed token losses are divided by,
    as Dr.GRPO does with the generation budget."""
    kl_coef: float = ranged(0.0, ge=0)
    """Coefficient of the KL to the reference policy (the weights at the start of the stage, frozen);
    0 disables it and no reference copy is kept. Applied per ``kl_mode``."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3"""
    kl_clamp: Optional[float] = ranged(10.0, gt=0)
    """k3 only: the per-token estimate is clamped to [-kl_clamp, kl_clamp] (> 0) in the loss and the
    reward penalty, as veRL's ``low_var_kl`` does (``torch.clamp(kld, min=-10, max=10)``): at
    ref - logp = 11.9 the unclamped k3 is 147,254 with gradient -147,265; clamped it is 10 with none.
    None: unclamped (only the exponent's +-20 guard). The logged approx/mismatch KL are never clamped."""
    kl_mode: str = "loss"
    """loss | reward"""
    entropy_coef: float = ranged(0.0, ge=0)
    """Entropy bonus (>= 0): the policy loss becomes pg_loss + kl term - entropy_coef x the entropy of
    the policy's token distributions (at the sampling temperature), aggregated over the trained tokens
    like the policy loss (``loss_agg``), its gradient flowing through the logits, as veRL's
    ``entropy_coeff`` (Search-R1 and RAG-R1: 0.001). 0: no bonus; the entropy is still logged."""
    off_policy: str = "tis"
    """none | tis | decoupled | vtrace | auto. How the learner corrects for rollouts sampled by another
    policy than the one it trains (a lagging version in async mode; the engine's precision even in sync):
    none (no correction: the PPO ratio against the engine's sampling logprobs, or with
    ``recompute_old_logprobs`` against the learner's own, as the papers' released trainers do),
    tis (truncated importance weights, ``tis_cap``), decoupled, vtrace, seq_mask (sequence-level masked
    importance sampling: a sequence whose geometric-mean weight exp(mean(proximal - behaviour)) over its
    trained tokens lies outside [``seq_mask_low``, ``seq_mask_high``] is left out of the loss and its
    denominators, the kept tokens weighted as tis; veRL's rollout correction with geometric rejection, after
    Liu, Li et al. 2025, "When Speed Kills Stability"). auto: tis when
    ``cluster.mode=async``, none when sync, resolved at load (what ``sonar config show`` prints): the
    paper recipes train on-policy as released and take the correction when ``configs/async.yaml`` makes
    them asynchronous."""
    recompute_old_logprobs: bool = False
    """``off_policy='none'``: the PPO ratio's "old" policy is the learner's own logprobs of the batch,
    recomputed in one no-grad pass before the first update (veRL's ``compute_log_prob``, OpenRLHF's
    ``make_experience``: what the papers' trainers do), instead of the logprobs the engine reported while
    sampling, which vLLM at top_p < 1 gives for the truncated distribution and computes with other
    kernels. Either way every step logs the engine-vs-learner gap over trained tokens,
    ``learner/sampling_kl/mean`` and ``/max`` (k3 of the engine's against the learner's logprobs, as veRL
    logs it), whenever that pass runs (this field, a KL reward, or tis/decoupled with several updates).
    The paper presets set it as their trainers do (``sonar config recipes``); off on CPU's exact engine."""
    tis_cap: float = ranged(2.0, gt=0)
    """Importance weight cap (> 0): ``tis`` truncates the weight exp(proximal - behaviour) to it;
    ``decoupled`` drops the tokens whose weight exceeds it."""
    seq_mask_low: float = ranged(0.5, gt=0, lt=1)
    """seq_mask only: sequences whose geometric-mean importance weight is below this (in (0, 1)) are masked."""
    seq_mask_high: float = ranged(2.0, gt=1)
    """seq_mask only: sequences whose geometric-mean importance weight is above this (> 1) are masked."""
    vtrace_rho_bar: float = ranged(1.0, gt=0)
    """vtrace only: truncation rho_bar of the per-token importance weight (> 0)."""
    vtrace_c_bar: float = ranged(1.0, gt=0)
    """vtrace only: truncation c_bar of the trace coefficients (> 0; IMPALA takes c_bar <= rho_bar)."""
    dynamic_sampling: Optional[bool] = None
    """Drop groups whose rewards are all equal (DAPO); counted in learner/groups_zero_signal. None: the
    algorithm's default, True for grpo and dr_grpo (such a group has zero advantage), False for the REINFORCE++
    variants (upstream keeps every sample: they still enter the batch whitening) and for ppo (its critic
    learns from every sample; a group of one is always "all equal")."""
    ppo_epochs: int = ranged(1, ge=1)
    """Passes over each rollout batch (>= 1), as OpenRLHF's ``max_epochs`` / veRL's ``ppo_epochs``."""
    mini_batches: int = ranged(1, ge=1)
    """Optimizer steps per pass (>= 1): the batch's trajectories are split, in batch order, into this many
    mini-batches (OpenRLHF: rollout samples / train_batch_size; R1-Searcher: 4). The "old" logprobs of the
    PPO ratio are the learner's own, computed once per batch before the first update (no gradient) and held
    fixed over every epoch and mini-batch, so from the second update on the ratio moves and the clip acts.
    A learner step is still one rollout batch: it takes ppo_epochs x mini_batches optimizer steps, then the
    policy version advances by one and the weights are pushed; the policy lag, ``replay.max_policy_lag``,
    ``stages.N.steps`` and the learning-rate schedule all count learner steps (rollout batches)."""


@dataclass(frozen=True)
class CriticConfig:
    """PPO's value model, used by the RL stages with ``algo.name=ppo`` (RAG-R1's ``adv_estimator=gae``).
    The learner builds it once when any stage runs ppo (``learner/critic.py``); advantages come from GAE
    over the critic's tokens (``tokens``; ``learner/algo/gae.py``). A ppo stage needs no group: one sample per prompt
    (``rollout.group_size=1``) is allowed, and dynamic sampling drops no group under ppo."""

    mode: str = "separate"
    """separate: a second model initialised from the policy directory, its LM head replaced by a scalar
    head (what veRL and RAG-R1 run); head: a scalar head on the policy's own trunk, reading its hidden
    states without gradient (the value loss trains only the head; no second model in memory)."""
    lr: float = ranged(3e-3, gt=0)
    """Constant AdamW learning rate of the critic (> 0), its own optimizer. RAG-R1 runs the critic at 10x
    the actor's (1e-5 vs 1e-6); 3e-3 is 10x the default RL stage lr of the tiny policy."""
    gamma: float = ranged(1.0, ge=0, le=1)
    """GAE discount in [0, 1] (RAG-R1: 1.0)."""
    lam: float = ranged(1.0, ge=0, le=1)
    """GAE lambda in [0, 1] (RAG-R1: 1.0)."""
    value_clip: float = ranged(0.5, ge=0)
    """epsilon_v of the clipped value loss (>= 0; 0 disables the clip): the prediction may move at most
    this far from V_old before its error stops counting (veRL's ``cliprange_value`` default, 0.5)."""
    warmup_steps: int = ranged(0, ge=0)
    """The first this-many steps of each ppo stage train only the critic; the policy is not updated
    (veRL's ``trainer.critic_warmup``; RAG-R1: 0)."""
    whiten: bool = True
    """Whiten the GAE advantages over the batch's trained tokens (veRL's ``masked_whiten``: mean 0, unbiased
    std 1) before the policy loss."""
    tokens: str = "model"
    """The tokens the critic works on: its values, the outcome reward's position, the GAE recursion, the
    whitening statistics and the value loss. ``model``: the policy's own tokens only (retrieved spans
    bridged; Sonar's default). ``response``: every token after the prompt, retrieved documents included,
    as RAG-R1's veRL fork does (``compute_advantage``: ``response_mask = attention_mask[:,
    -response_length:]``, whitened by ``masked_whiten`` over it; the critic's loss over the same mask).
    The policy loss is over the model's tokens either way."""
    terminal_value: Optional[bool] = None
    """Train V of the state after each response's last token toward its return 0, as RAG-R1's veRL fork does
    (values and value loss under ``attention_mask[:, -R-1:-1]``, for every response shorter than the batch's
    longest; ``learner/critic.py``: ``trains_terminal_value``). None: on exactly with ``critic.tokens='response'``."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021) trained in place of the policy's weights, with ``peft``: the
    base stays frozen, every algorithm and SFT train the adapters only, and each weight push moves only
    them (``learner/README.md``, "LoRA")."""

    rank: int = ranged(0, ge=0)
    """Adapter rank r (0: off, the whole model is trained). OpenRLHF's ``--lora_rank``, veRL's ``lora_rank``."""
    alpha: float = ranged(32.0, gt=0)
    """The adapter's output is scaled by alpha / r (peft's ``lora_alpha``; 32 = OpenRLHF's and veRL's
    examples at r 16-64)."""
    dropout: float = ranged(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (peft's ``lora_dropout``; 0 as OpenRLHF's default)."""
    target_modules: List[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Module names (their last component) that get adapters: every linear layer of a Qwen2 / Llama block
    by default (what veRL's ``all-linear`` selects there; attention and MLP both, which LoRA for RL needs
    to match full fine-tuning: Schulman et al., "LoRA Without Regret", Thinking Machines 2025)."""
    lr_scale: float = ranged(10.0, gt=0)
    """Every stage's ``lr`` is multiplied by this while LoRA is on: LoRA's best learning rate is about 10x
    full fine-tuning's, for SFT and RL alike, at every rank (Schulman et al. 2025, the same study), at the
    rates of pretrained LLMs (1e-6 to 1e-5). Not at the embedded tiny policy's 3e-4: its RL on LoRA at 10x
    collapsed (reward 0.8 to 0 by step 230 of 500), at 1x it learns (``sonar bench lora`` runs it so)."""


@dataclass(frozen=True)
class LearnerConfig:
    """The DeepSpeed learner."""

    weight_decay: float = ranged(0.0, ge=0)
    """AdamW decoupled weight decay (>= 0)."""
    betas: List[float] = ranged(default_factory=lambda: [0.9, 0.99], ge=0, lt=1)
    """AdamW [beta1, beta2], each in [0, 1)."""
    warmup_steps: int = ranged(5, ge=0)
    """Linear warmup at the start of every stage, in learner steps (>= 0; one per batch, each of
    ``algo.ppo_epochs`` x ``algo.mini_batches`` optimizer steps at the same lr): step s of the stage runs at
    lr * (s + 1) / warmup_steps until s reaches it."""
    lr_decay: str = "constant"
    """constant | cosine | linear (after warmup, over the stage length)"""
    grad_clip: float = ranged(1.0, ge=0)
    """Clip of the global gradient L2 norm (>= 0; 0 disables), DeepSpeed's ``gradient_clipping``."""
    zero_stage: int = ranged(0, ge=0, le=3)
    """DeepSpeed ZeRO stage, 0-3 (3 partitions the parameters; the weight push gathers them first)."""
    precision: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16"""
    groups_per_step: int = ranged(8, ge=1)
    """Whole groups per learner step (one rollout batch; ``algo.mini_batches`` split it into optimizer steps)."""
    micro_batch_tokens: int = ranged(8192, ge=1)
    """Micro-batches are packed by token budget (padded length x rows)."""
    gradient_checkpointing: bool = False
    """Recompute activations during the backward pass: less activation memory for one more forward."""
    logits_chunk_tokens: int = ranged(1024, ge=0)
    """Token logprobs and entropy computed from the final hidden states in chunks of this many tokens
    (>= 0; 0: unchunked, the model's full [tokens, vocab] float32 logits of a micro-batch at once). Each
    chunk's logits are recomputed in the backward pass (``learner/algo/chunked.py``), so at most this many
    tokens' logits exist at once: 1024 x 151,936 float32 is 0.6 GiB, against 18.5 GiB unchunked for a
    32,768-token micro-batch. Same results as unchunked up to float rounding."""
    broadcast_every: int = ranged(1, ge=1)
    """Push weights to the rollout workers every k learner steps."""
    dist_backend: str = "auto"
    """auto (nccl on GPU, gloo on CPU) | gloo | nccl"""
    num_gpus: float = ranged(0.0, ge=0)
    """Ray GPUs for each learner rank (at most 1: one GPU per rank; more GPUs means more ranks,
    ``learner.num_ranks``); > 0 with CUDA present trains on the GPU (then ``precision=auto`` means bf16
    and ``dist_backend=auto`` means nccl)."""
    num_cpus: float = ranged(1.0, ge=0)
    """Ray CPUs reserved for each learner rank (placement)."""
    num_ranks: int = ranged(1, ge=1)
    """Data-parallel DeepSpeed ranks of the learner (>= 1): one Ray actor per rank (one GPU each, or a
    gloo process on CPU) in one placement group, one torch.distributed group; ZeRO shards across them
    and every step's batch is split across them by token budget. Rank 0 talks to the driver."""
    placement_strategy: str = "STRICT_PACK"
    """Ray placement-group strategy of the learner ranks' bundles: STRICT_PACK (one node) | PACK |
    SPREAD | STRICT_SPREAD."""
    rendezvous: str = "auto"
    """Address rank 0 binds the learner ranks' torch.distributed store on: auto (the node address Ray
    reports: 127.0.0.1 on a local loopback cluster, the node IP on a real one) | loopback (127.0.0.1
    always; all ranks must then share rank 0's node)."""
    offload_while_generating: bool = False
    """``cluster.placement=colocated``: while the engines on the learner's GPUs generate, the learner's
    optimizer states and gradients wait in host memory (DeepSpeed's ``offload_states``, reloaded before the
    next step; OpenRLHF's ``--deepspeed_enable_sleep``), so generation has the GPU less the bf16 parameters.
    The memory plan's colocated generation row counts what stays (``cluster/wire/memory.py``). On CPU
    there is nothing to move: the learner reports the phase and moves nothing."""
    offload_optimizer: bool = False
    """ZeRO-Offload of the optimizer state to CPU memory (needs learner.zero_stage >= 1). The learner
    then uses DeepSpeed's own AdamW (DeepSpeedCPUAdam, JIT-built on first use) instead of torch's."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train low-rank adapters instead of the whole model (``lora.rank`` > 0)."""


@dataclass(frozen=True)
class ReplayConfig:
    """The replay queue between rollout workers and the learner."""

    capacity_groups: int = ranged(16, ge=1)
    """Backpressure: workers wait when this many groups are queued."""
    max_policy_lag: int = ranged(2, ge=0)
    """Staleness bound in learner versions (0 = fully on-policy)."""
    stale_policy: str = "drop"
    """drop (and count) | downweight (keep, weight gamma**(lag - bound))"""
    stale_downweight: float = ranged(0.5, ge=0, le=1)
    """stale_policy=downweight: gamma in (0, 1]; a group past the bound keeps the loss weight
    gamma ** (lag - max_policy_lag)."""
    max_inflight_groups: int = ranged(-1, ge=-1)
    """Async admission budget: a worker may claim prompts only while groups claimed-but-not-put plus
    groups queued stay within this. -1: (max_policy_lag + 1) * learner.groups_per_step, at least
    rollout.groups_per_request (AReaL's staleness-aware admission); 0: unlimited (only capacity_groups
    and the lag drop bound). Sync mode is never gated: its batch is the step. With a budget, a claim
    also names the policy version the worker holds and must fit in the groups the learner takes while
    that version is fresh (cluster/replay/queue.py, version-aware admission). With a budget, a worker's
    engine also holds at most the groups it decodes at once (``worker_capacity``), counted in the rows on
    it (a trajectory waiting on a search holds no engine row), and the least-loaded waiting worker claims
    first."""
    just_in_time: bool = True
    """Async runs with a budget: when the learner is the bottleneck, a claim waits until its group would
    be done no earlier than the learner's take before the one that trains it (measured generation time
    and take interval, cluster/replay/queue.py), instead of filling the pipeline to the staleness bound
    with groups that would only age in the queue. A rollout-bound run is not held back."""


@dataclass(frozen=True)
class RewardConfig:
    """Outcome reward (``actors/rewards.py`` has the formulas). Each part is logged separately."""

    name: str = "answer_em"
    """answer_em | answer_f1 | cover_em (R1-Searcher's ACC_R) | search_r1 | rag_r1 (both: EM of the answer,
    no format term, as Search-R1's and RAG-R1's ``qa_em.py``) | r1_stage1 | r1_stage2 (R1-Searcher)."""
    format_weight: float = ranged(0.1, ge=0)
    """Weight (>= 0) of the format term added to answer_em / answer_f1 / cover_em."""
    format_penalty: float = ranged(-2.0, le=0)
    """R1-Searcher stage 2 (<= 0): added to the F1 when the format is broken. -2 as the paper, its README
    and the Qwen reward server; the Llama stage-2 server uses -1."""
    variant: str = "paper"
    """R1-Searcher rewards only: paper (the paper's formulas, Sonar's finish reason as the format) |
    code_qwen (``reward_server_qwen_zero.py``: stage 2 only) | code_llama (``reward_server_llama_stage1/2.py``):
    the released servers' rules (tag counts, one answer, <= 10 words, a document per query, cover-EM term in
    stage 1). README "Rewards and metrics: paper vs released code" lists every difference."""
    timeout_s: float = ranged(30.0, gt=0)
    """A reward plug-in's call longer than this (seconds) is abandoned and scores as a reward error, like a
    tool's call past its timeout (a hung plug-in would stop the worker, then the run)."""


@dataclass(frozen=True)
class StageConfig:
    """One stage of a run; the next stage starts from this one's weights."""

    name: str = "rl"
    """Label of the stage in the driver's log lines."""
    kind: str = "rl"
    """sft | rl"""
    steps: int = ranged(60, ge=0)
    """Learner steps in this stage."""
    lr: float = ranged(3e-4, gt=0)
    """Peak AdamW learning rate of this stage (> 0), the only source of the learning rate: warmup and
    decay (``learner.warmup_steps`` / ``learner.lr_decay``) shape it over the stage's steps. The default
    suits RL; SFT wants about 10x more (configs/tiny.yaml: 3e-3)."""
    batch_size: int = ranged(64, ge=1)
    """SFT only: demonstrations per step."""
    difficulty: List[float] = ranged(default_factory=lambda: [0.0, 1.0], ge=0, le=1)
    """RL only: train a group only if its measured success rate (mean EM of its samples) lies in
    [lo, hi]; e.g. [0.0, 0.75] keeps R1-Searcher's medium and hard prompts. Filtered groups are counted."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward of this stage's rollouts; the last stage's also scores held-out evaluation."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Policy-gradient algorithm of an RL stage (unused by SFT)."""
    data: Optional[Union[str, List[str]]] = None
    """RL only: dataset file(s) whose questions this stage trains on (one path or a list, read in order
    as one set by ``actors/datasets.py:load_datasets``: FlashRAG/Search-R1 JSONL, HotpotQA, 2Wiki,
    MuSiQue, Bamboogle, R1-Searcher's JSONL, RAG-R1's JSON, Search-R1/RAG-R1 parquet). Needs
    ``retrieval.corpus`` (the passages that answer them). None: the synthetic world's training
    questions. Read by the driver (prompt count, vocabulary) and by every rollout worker (the prompts);
    relative paths are relative to where ``sonar`` starts, and must be readable on every node."""
    format: str = "auto"
    """Format of ``data`` (``actors.datasets.FORMATS`` or an alias), when detection from the content is
    ambiguous; "auto" detects per file; or a dataset plug-in ``module:attr`` / ``file.py:attr``: a
    ``load(path) -> iterable`` of dicts with ``question`` and ``golds`` (optional ``qid``, ``meta``) or of
    ``QAItem`` (``cluster/wire/plugins.py``)."""
    fields: Dict[str, str] = field(default_factory=dict)
    """A field mapping for any JSONL / JSON-list / parquet file, instead of a known format: Sonar's key ->
    the record's key, dotted for nested keys (``question: query``, ``golds: answers.text``, optional
    ``qid: id``); a gold that is one string becomes a list of one; every other small scalar field is
    kept as the item's metadata. Set, it replaces ``format``'s loader (``actors/datasets.py:load_mapped``)."""


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation (greedy, the policy writing its own queries, retrieval in the loop)."""

    before: bool = True
    """Evaluate held-out EM before RL (after SFT) as well as after."""
    no_search: bool = True
    """Also evaluate with search disabled (every search returns no documents)."""
    batch_size: int = ranged(64, ge=1)
    """Questions per batched greedy rollout call (>= 1), in training evaluation and ``sonar eval``."""
    data: Optional[Union[str, List[str]]] = None
    """Held-out evaluation questions from dataset file(s) (as ``stages.N.data``; needs ``retrieval.corpus``);
    None: the synthetic world's held-out questions (``world.num_heldout_eval``). Read by the driver."""
    format: str = "auto"
    """Format of ``eval.data``, as ``stages.N.format`` (a plug-in too)."""
    fields: Dict[str, str] = field(default_factory=dict)
    """A field mapping for ``eval.data``, as ``stages.N.fields``."""


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow: where the run's params, metrics and artifacts go (only the driver writes)."""

    uri: Optional[str] = None
    """MLflow tracking URI; None: ``MLFLOW_TRACKING_URI`` if set, else one sqlite store per project,
    ``<run.root>/mlflow.db``, shared by every run, resume and ``sonar eval``. Tokens come from
    MLFLOW_TRACKING_TOKEN."""
    experiment: Optional[str] = None
    """MLflow experiment name (created when missing); None: ``MLFLOW_EXPERIMENT_NAME`` if set, else "sonar"."""
    enabled: bool = True
    """False: no MLflow run; metrics still land in <run_dir>/metrics.jsonl."""
    log_model: bool = True
    """Log the final policy with MLflow's transformers flavour (a text-generation model, HF folder inside)."""
    registered_model_name: str = ""
    """Register the logged final policy under this model-registry name (needs ``log_model``); "": do not register."""
    async_logging: bool = True
    """Metrics go to MLflow from a background thread in batches (MLflow's async logging, buffered 1 s
    unless ``MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS`` says otherwise); the run's end (FINISHED, KILLED or
    FAILED) flushes them. False: each step's ``log_metrics`` waits for the store."""
    system_metrics: bool = True
    """Log CPU, memory, disk and network (GPU with pynvml) as ``system/*`` metrics beside the run."""


@dataclass(frozen=True)
class ClusterConfig:
    """Ray: which cluster, how roles are placed, and how failures and timeouts are handled."""

    address: Optional[str] = None
    """Ray address to join; None: RAY_ADDRESS if set, else a local cluster on 127.0.0.1."""
    num_cpus: Optional[int] = ranged(None, ge=1)
    """CPUs of the local cluster (None: detect)."""
    max_worker_restarts: int = ranged(2, ge=0)
    """Restarts allowed per rollout worker before the run fails (>= 0). Every driver call to a worker
    goes through one place (``RolloutPool.call``): a dead worker is restarted, its claimed prompts
    requeued and the broadcast group rebuilt; past this many restarts the run fails naming the worker."""
    max_replica_restarts: int = ranged(2, ge=0)
    """Ray restarts of each retrieval replica after its process dies (the actor's ``max_restarts``, >= 0);
    the driver pings the replicas every RL step. One whose restarts are used up is replaced
    (``max_replica_replacements``); past those, the run fails, naming the replicas, once none is left alive."""
    max_replica_replacements: int = ranged(2, ge=0)
    """New actors the driver starts in the place of each retrieval replica that is dead for good (its
    ``max_replica_restarts`` used up, >= 0; 0: none), handing the workers' clients the new handle; each new
    one has its own Ray restarts. Counted in ``retrieval/replicas_replaced``. Bounded so that a replica
    that cannot live (a broken index) ends the run instead of being replaced for ever."""
    retrieval_wait_s: float = ranged(120.0, gt=0)
    """While no retrieval replica is healthy, a search waits up to this many seconds for one to come
    back (> 0) instead of failing at once; a search that still fails is an infrastructure failure."""
    requeue_failed_searches: bool = True
    """A group in which a search failed for infrastructure reasons (timeout, connection, dead replica,
    internal error) is not trained: its prompt is requeued (counted as ``replay/requeued``). False:
    such searches stay data (a "no results" document), as before."""
    auto_resume: int = ranged(1, ge=0)
    """How many times the driver restarts the run's roles from the last complete checkpoint of this
    run when the learner or the replay queue dies (>= 0; 0: such a death fails the run)."""
    health_timeout_s: float = ranged(60.0, gt=0)
    """A worker silent for this long is reported dead."""
    step_timeout_s: float = ranged(600.0, gt=0)
    """A learner step that takes longer fails the run loudly (no silent hang); also the bound on one
    search of the held-out evaluation (see ``retrieval.timeout_s``) and, unless
    ``broadcast_timeout_s`` is set, on every wait of a weight push."""
    broadcast_timeout_s: Optional[float] = ranged(None, gt=0)
    """The weight-broadcast group's timeout, seconds (> 0; None: ``step_timeout_s``): the bound on its
    rendezvous and on every wait of a push. A dead receiver or learner raises at the call within it, so
    a worker that dies mid-push, or inside the backend's rendezvous, costs at most this long before the
    group forms again (one found dead before every rank arrived calls the formation off at once: the
    presence barrier, ``cluster/transport/weights.py``); a vLLM engine in ``rollout.weight_update='pause'`` drains its rows in flight inside it. NCCL's
    watchdog gets this plus a margin (``cluster/transport/weights.py``)."""

    def broadcast_timeout(self) -> float:
        """``broadcast_timeout_s``, or ``step_timeout_s`` where it is None (seconds)."""
        return self.step_timeout_s if self.broadcast_timeout_s is None else self.broadcast_timeout_s
    mode: str = "async"
    """async: workers generate while the learner trains (bounded by replay.max_policy_lag);
    sync: generate a batch, then train, then broadcast, in lockstep (the baseline async is measured against)."""
    placement: str = "split"
    """split: the learner ranks and the rollout engines on devices of their own, weights pushed by a
    broadcast group (NCCL between GPUs, gloo otherwise). colocated: each learner rank shares its device
    with one engine and the two take turns (veRL's hybrid engine, OpenRLHF's ``--colocate_all_models``):
    the engines generate a batch, sleep (``rollout.sleep_level``), the learner trains, the new weights are
    handed over on the device (``cluster/transport/handover.py``: shared memory on CPU, CUDA IPC on GPU; NCCL
    refuses two ranks of one GPU), the engines wake and generate again. Sync only (``cluster.mode=sync``):
    generation and training cannot overlap on one device. On GPU it needs learner.num_gpus=1,
    rollout.num_gpus_per_worker=1 (the GPU each shares) and one vLLM engine per learner rank
    (rollout.num_workers = learner.num_ranks, tensor_parallel_size 1)."""
    bind_host: str = "auto"
    """Where the learner's weight-broadcast rendezvous listens and the workers dial it. auto: 127.0.0.1
    when the Ray cluster has one node, else the learner's node address (``ray.util.get_node_ip_address``);
    loopback: 127.0.0.1 (every role on one node); or an address of the learner's node."""
    role_resources: Dict[str, Dict[str, float]] = field(default_factory=dict)
    """Extra Ray resources per role, to pin roles to node types: keys learner | rollout | retrieval
    (e.g. ``{learner: {node_gpu: 1}, rollout: {node_rollout: 1}}``, custom resources the nodes declare),
    added to the CPUs/GPUs each role already asks for; a rollout entry is per worker. Values >= 0."""
    upload_files: bool = False
    """When the learner's node cannot see ``run.dir`` (no shared storage, checked at start): false fails
    the run at start naming the directory; true streams the learner's checkpoints and HF export to the
    driver's ``run.dir`` through the Ray object store after each save (a resume then needs the files where
    the learner runs: put ``run.root`` on shared storage for ``run.resume``/``cluster.auto_resume``)."""
    gpu_memory_gib: Optional[float] = ranged(None, gt=0)
    """Memory of each GPU in GiB (> 0), what the memory plan checked at load must fit
    (``cluster/wire/memory.py``: per learner GPU and per vLLM GPU). None: ``$SONAR_GPU_MEMORY_GIB`` (the
    shipped cluster files set it from their GPU node type), else 80 (an H100/A100-80G, said in the plan
    as assumed). Give what torch reports (``total_memory``): an 80 GB H100 or A100 has about 79.1 GiB."""


@dataclass(frozen=True)
class RunConfig:
    """Naming, seeding, directories, checkpoints and resume of one run."""

    name: str = "tiny"
    """Prefix of the run directory and the MLflow run name."""
    seed: int = ranged(0, ge=0)
    """Seed of what is random at run time: the learner's torch RNG, the SFT batch order, the prompt
    order of the replay cursor and the rollout workers' sampling seeds. The world (``world.seed``) and
    the random model's init (``model.seed``) have their own."""
    root: str = ""
    """Run directories (and the corpus, index and vector caches) are created under this folder, made
    absolute at load (``cluster/wire/paths.py``). Empty: ``$SONAR_RUN_ROOT``, else ``./runs``; inside a
    Ray job's uploaded working directory (Ray's temporary package folder) relative paths go under
    ``$SONAR_RUN_ROOT`` or ``~/sonar-runs`` instead, never into that folder."""
    run_dir: Optional[str] = None
    """Explicit run directory (default: <root>/<name>-<timestamp>); relative: against the same base as root."""
    resume: Optional[str] = None
    """Checkpoint path, run directory, or 'latest': the newest checkpoint under ``root`` of a run of this
    ``name`` (and of ``tracking.experiment`` when it is set; read from each run's saved config.yaml), so
    experiments sharing one root never resume each other's runs."""
    checkpoint_every: int = ranged(0, ge=0)
    """Learner steps between checkpoints (0: only at the end of each stage)."""
    keep_checkpoints: int = ranged(0, ge=0)
    """Complete checkpoints kept in the run directory: after each save the oldest beyond this many are
    deleted (never the newest complete one, never one being written). 0: keep all."""
    log_every: int = ranged(1, ge=1)
    """SFT stages: send the learner's metrics to MLflow every this many steps (>= 1). RL steps are
    always logged (the run summary reads every one)."""


@dataclass(frozen=True)
class Config:
    """A whole run. Each component receives only its own section."""

    run: RunConfig = field(default_factory=RunConfig)
    """Naming, seeding, directories, checkpoints, resume."""
    world: WorldConfig = field(default_factory=WorldConfig)
    """The synthetic world: corpus and questions."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy."""
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    """Tags, turn and token budgets of a trajectory."""
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    """Search backend, reranker, cache and the retrieval service."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout workers, engines and sampling."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Optimizer, DeepSpeed and batching of the learner."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's value model and GAE (read only when a stage runs ``algo.name=ppo``)."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """The queue between workers and learner: backpressure, staleness, admission."""
    stages: List[StageConfig] = field(default_factory=lambda: [StageConfig()])
    """Stages in order (at least one); each starts from the previous one's weights."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation before and after RL."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray cluster, placement, fault handling, timeouts."""
    plugins: Dict[str, str] = field(default_factory=dict)
    """Filled at load, not set by hand: the source of each file plug-in the config names (path as written
    -> the file's text), read once by ``validate`` so the code travels with the config to every Ray
    process on any node, and the run's saved config records the code it ran (``cluster/wire/plugins.py``)."""


BUILTIN_NAMES = _plugins.BUILTIN_NAMES

_CHOICES = {
    "model.tags": ("auto", "text", "special"),
    "protocol.name": ("r1_searcher", "search_r1", "rag_r1", "rag_r1_multi"),
    "protocol.template": ("base", "chat"),
    "protocol.prompt": ("short", "r1_searcher_base", "r1_searcher_instruct", "r1_searcher_eval", "search_r1", "rag_r1"),
    "protocol.rules": ("sonar", "upstream"),
    "protocol.on_invalid": ("message", "end"),
    "retrieval.backend": BUILTIN_NAMES["retriever"],
    "retrieval.rerank": ("none", "dense", "cross"),
    "rollout.engine": ("hf", "vllm"),
    "rollout.weight_update": ("pause", "interrupt", "auto"),
    "rollout.vllm_dtype": ("auto", "float32", "bfloat16", "float16"),
    "cluster.mode": ("async", "sync"),
    "cluster.placement": ("split", "colocated"),
    "learner.lr_decay": ("constant", "cosine", "linear"),
    "learner.precision": ("auto", "fp32", "bf16"),
    "learner.dist_backend": ("auto", "gloo", "nccl"),
    "learner.placement_strategy": ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"),
    "learner.rendezvous": ("auto", "loopback"),
    "replay.stale_policy": ("drop", "downweight"),
    "critic.mode": ("separate", "head"),
    "critic.tokens": ("model", "response"),
}
DATA_FORMATS = ("auto", "flashrag", "hotpotqa", "2wiki", "musique", "bamboogle", "r1_searcher", "verl",
                "search_r1", "jsonl", "rag_r1", "hotpot", "2wikimultihopqa", "search_r1_parquet", "parquet")
"""``stages.N.format`` / ``eval.format``: "auto", ``actors.datasets.FORMATS`` and its aliases (a test
keeps the two lists equal; the wire imports nothing of the actors)."""

_STAGE_CHOICES = {
    "kind": ("sft", "rl"),
    "algo.name": BUILTIN_NAMES["algorithm"],
    "algo.loss_agg": (None, "token_mean", "seq_mean_token_mean", "seq_sum_norm"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.kl_mode": ("loss", "reward"),
    "algo.off_policy": ("none", "tis", "decoupled", "vtrace", "seq_mask", "auto"),
    "reward.name": BUILTIN_NAMES["reward"],
    "reward.variant": ("paper", "code_qwen", "code_llama"),
}


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def algo_std_normalize(a: AlgoConfig) -> bool:
    """Resolved ``algo.std_normalize``: the explicit value, else the algorithm's default (``AlgoSpec``: True
    for grpo and ppo)."""
    return a.std_normalize if a.std_normalize is not None else spec_of(a.name).std_normalize


def algo_dynamic_sampling(a: AlgoConfig) -> bool:
    """Resolved ``algo.dynamic_sampling``: the explicit value, else the algorithm's default (``AlgoSpec``: True
    for grpo and dr_grpo)."""
    return a.dynamic_sampling if a.dynamic_sampling is not None else spec_of(a.name).dynamic_sampling


def proximal_forward_runs(a: AlgoConfig) -> bool:
    """Whether a learner step recomputes the batch's logprobs in one no-grad pass before its first update
    (the proximal policy): tis or decoupled with several updates (``ppo_epochs`` x ``mini_batches``),
    seq_mask always (its mask is decided before the update), none with ``recompute_old_logprobs``.
    A reward-mode KL runs the same pass for its own use (``learner/train_step.py``). The one statement of
    it: the learner and the benchmarks' learner cost read it here."""
    if a.off_policy == "auto":
        raise ValueError("algo.off_policy='auto' is resolved at load (tis in async mode, none in sync): pass the "
                         "resolved algo")
    updates = a.ppo_epochs * a.mini_batches
    return ((updates > 1 and a.off_policy in ("tis", "decoupled")) or a.off_policy == "seq_mask"
            or (a.off_policy == "none" and a.recompute_old_logprobs))


def algo_loss_agg(a: AlgoConfig) -> str:
    """Resolved ``algo.loss_agg``: the explicit value, else the algorithm's default (``AlgoSpec``:
    seq_sum_norm for dr_grpo, token_mean otherwise)."""
    if a.loss_agg is not None:
        return a.loss_agg
    return spec_of(a.name).loss_agg


ROLE_NAMES = ("learner", "rollout", "retrieval")
"""The roles ``cluster.role_resources`` may pin."""


def pool_bounds(cfg: "Config") -> tuple[int, int]:
    """Resolved (``rollout.min_workers``, ``rollout.max_workers``): None is ``rollout.num_workers``."""
    r = cfg.rollout
    return (r.num_workers if r.min_workers is None else r.min_workers,
            r.num_workers if r.max_workers is None else r.max_workers)


def inflight_budget(cfg: "Config") -> int:
    """Resolved ``replay.max_inflight_groups`` in async mode (0: unlimited); sync mode is never gated."""
    if cfg.cluster.mode != "async":
        return 0
    b = cfg.replay.max_inflight_groups
    if b == -1:  # never below one request, or every request would have to run alone
        return max((cfg.replay.max_policy_lag + 1) * cfg.learner.groups_per_step, cfg.rollout.groups_per_request)
    return b


def worker_capacity(cfg: "Config") -> int:
    """Groups one rollout worker may hold claimed at once under an admission budget (0: no bound): what an
    engine that batches concurrent calls decodes together, ``rollout.max_batch_rows // rollout.group_size``
    (at least 1). A static engine runs one lane's request at a time, and its lanes
    (``rollout.batches_in_flight`` x ``rollout.groups_per_request``) already bound it."""
    r = cfg.rollout
    if not inflight_budget(cfg) or not (r.continuous_batching or r.engine == "vllm"):
        return 0
    return max(1, r.max_batch_rows // r.group_size)


def schema_fields(cls: Optional[type] = None, prefix: str = ""):
    """(dotted key, ``dataclasses.Field``, owning class) of every leaf field of the schema, in schema order:
    a section (a dataclass field) is walked, a list of dataclasses (``stages``) as ``stages.N.``."""
    cls = Config if cls is None else cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if dataclasses.is_dataclass(t):
            yield from schema_fields(t, f"{prefix}{f.name}.")
        elif typing.get_origin(t) is list and args and dataclasses.is_dataclass(args[0]):
            yield from schema_fields(args[0], f"{prefix}{f.name}.N.")
        else:
            yield prefix + f.name, f, cls


def field_docs() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the field's docstring, whitespace collapsed: the string under each
    field in this file, its one description (read from the source: Python keeps no attribute
    docstrings). Empty when the source is not shipped."""
    import ast

    try:
        tree = ast.parse(Path(__file__).read_text())
    except OSError:
        return {}
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for st, nxt in zip(node.body, node.body[1:]):
                if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and isinstance(nxt, ast.Expr)
                        and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                    out[(node.name, st.target.id)] = " ".join(nxt.value.value.split())
    return out


def describe_fields(prefixes: Sequence[str] = ()) -> list[tuple[str, str, Any, Optional[Range], str]]:
    """(dotted key, type, default, range or None, description) of every leaf field whose key starts with
    one of ``prefixes`` (all when empty): what ``sonar config fields`` prints."""
    docs = field_docs()
    out = []
    for key, f, cls in schema_fields():
        if prefixes and not any(key == p or key.startswith(p.rstrip(".") + ".") for p in prefixes):
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        out.append((key, str(f.type), default, f.metadata.get("range"), docs.get((cls.__name__, f.name), "")))
    return out


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_ranges(cfg: Any, path: str = "") -> None:
    """Every numeric field of the config (recursively, every stage) against the range its field declares
    (``ranged``): a value out of its range, NaN or inf raises ValueError naming the dotted field and the
    value. Runs before every other check, so those may assume each number is finite and in its range."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        p, rng = f"{path}{f.name}", f.metadata.get("range")
        if dataclasses.is_dataclass(value):
            _check_ranges(value, p + ".")
        elif isinstance(value, (list, tuple)) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                _check_ranges(item, f"{p}[{i}].")
        elif isinstance(value, (list, tuple)) and value and all(_numeric(v) for v in value):
            for i, v in enumerate(value):
                _check_range(f"{p}[{i}]", rng, v)
        elif _numeric(value):
            _check_range(p, rng, value)


MAX_SECONDS = 30 * 86400.0
"""The longest duration any ``*_s`` field may hold (30 days): past it a deadline is no deadline a user could
mean, and a huge one overflows where it is used (``ray.get(timeout=1e308)`` raises ``OverflowError``)."""


def _check_range(path: str, rng: Optional[Range], value: float) -> None:
    """One number: finite if a float (whether or not a range is declared), inside ``rng``, and a duration
    (a field named ``*_s``) at most :data:`MAX_SECONDS`."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path}={value} must be a finite number" + (f" {rng}" if rng is not None else ""))
    if rng is not None and value not in rng:
        raise ValueError(f"{path}={value} must be {'in ' if rng.is_interval else ''}{rng}")
    if path.rsplit(".", 1)[-1].endswith("_s") and value > MAX_SECONDS:
        raise ValueError(f"{path}={value} seconds is past {MAX_SECONDS:.0f} (30 days): no deadline or duration "
                         "a run could mean")


_NOTES: "contextvars.ContextVar[Optional[list]]" = contextvars.ContextVar("sonar_config_notes", default=None)
"""Where the checks of files that live on the cluster (dataset files, the model's config.json) report
what they could not check here, when the caller asked for notes (``validate(cfg, notes=[...])``: the
``sonar config`` verbs on a laptop); None (``sonar train``): a missing file is an error."""


def not_checked(what: str) -> bool:
    """Record that ``what`` could not be checked on this machine. True when the caller collects notes
    (the check is then skipped), False when it does not (the check must raise)."""
    notes = _NOTES.get()
    if notes is None:
        return False
    if what not in notes:
        notes.append(what)
    return True


def validate(cfg: Config, notes: Optional[list] = None) -> Config:
    """Every check, one function per section; each raises ValueError naming the fields and values.

    First every number against the range declared beside its field (:func:`_check_ranges`), so the
    section checks hold only what a range cannot say (a relation between values, a choice, a file).
    A check that relates two sections lives with the field it constrains (e.g. ``replay.capacity_groups``
    against ``learner.groups_per_step`` in :func:`_check_replay`). ``notes``: a list to collect what could
    not be checked here (files on the cluster's storage) instead of failing on it (``not_checked``)."""
    cfg = resolve_auto(cfg)
    token = _NOTES.set(notes)
    try:
        _check_ranges(cfg)
        cfg = resolve_plugins(cfg)
        _check_plugins(cfg)
        _check_model(cfg)
        _check_protocol(cfg)
        _check_retrieval(cfg)
        _check_rollout(cfg)
        _check_learner(cfg)
        _check_critic(cfg)
        _check_replay(cfg)
        _check_stages(cfg)
        _check_eval(cfg)
        _check_cluster(cfg)
        _check_colocated(cfg)
        _check_run(cfg)
        _check_tracking(cfg)
        _check_memory(cfg)  # last: the other checks' messages are more specific than a plan of a bad config
    finally:
        _NOTES.reset(token)
    return cfg


def resolve_auto(cfg: Config) -> Config:
    """Values that depend on another section, made concrete (idempotent): ``stages.N.algo.off_policy=auto``
    is tis in async mode and none in sync mode (``AlgoConfig.off_policy``); ``rollout.weight_update=auto``
    is interrupt in async mode and pause in sync mode (``RolloutConfig.weight_update``)."""
    is_async = cfg.cluster.mode == "async"
    concrete = "tis" if is_async else "none"
    stages = [dataclasses.replace(st, algo=dataclasses.replace(st.algo, off_policy=concrete))
              if st.algo.off_policy == "auto" else st for st in cfg.stages]
    out = cfg if stages == list(cfg.stages) else dataclasses.replace(cfg, stages=stages)
    if out.rollout.weight_update == "auto":
        out = dataclasses.replace(out, rollout=dataclasses.replace(
            out.rollout, weight_update="interrupt" if is_async else "pause"))
    return out


def _check_memory(cfg: Config) -> None:
    """The GPU memory plan (``cluster/wire/memory.py``) must fit ``cluster.gpu_memory_gib``; refused with
    the plan's figures and the fields to change. Nothing to do (and nothing imported: the plan needs
    transformers) when the run uses no GPU; a ``config.json`` not readable here is never an error (the
    CLI says the plan was not checked)."""
    if not (cfg.learner.num_gpus > 0 or cfg.rollout.num_gpus_per_worker > 0):
        return
    from sonar.cluster.wire.memory import MemoryPlanError, plan_for, sync_floor_of

    plan, _ = plan_for(cfg)
    if plan is not None and not plan.fits:
        raise MemoryPlanError(plan)  # a ValueError: the refusal with its figures; ``.plan`` the whole plan
    floor = sync_floor_of(cfg, plan.shape) if plan is not None else None
    if floor is not None and cfg.cluster.step_timeout_s < floor.seconds:
        raise ValueError(
            f"cluster.step_timeout_s={cfg.cluster.step_timeout_s:g} bounds a whole sync batch (cluster.mode='sync'), "
            f"and the longest batch this config allows needs at least {floor.seconds:,.0f} s: {floor.text()} "
            "(cluster/wire/deadlines.py); raise cluster.step_timeout_s, or bound the batch (protocol.max_turns, "
            "protocol.max_new_tokens_per_turn, learner.groups_per_step, rollout.num_workers)")



PLUGIN_FIELDS = {"retrieval.backend": "retriever", "reward.name": "reward", "format": "dataset", "tools": "tool",
                 "algo.name": "algorithm"}
"""Choice fields that also take a plug-in ``module:attr`` / ``file.py:attr`` (``cluster/wire/plugins.py``),
by field (a stage's, eval's or the protocol's) -> plug-in kind."""

PLUGIN_ARITY = {"reward": (1, 2), "retriever": (3, 3), "dataset": (1, 1), "tool": (1, 1), "algorithm": (3, 3)}
"""Positional arguments each kind of plug-in is called with (least, most): ``reward(sample[, config])``,
``make(config, corpus, index_root)``, ``load(path)``, ``make(config)``, ``fn(rewards, group_index, mask, *, ...)``."""


def _check_choices(cfg: Config, section: str) -> None:
    for key, allowed in _CHOICES.items():
        if key.startswith(section + "."):
            value = _get(cfg, key)
            if value not in allowed and not (key in PLUGIN_FIELDS and _plugins.is_plugin(value)):
                plug = " nor a plug-in 'module:attr' / 'file.py:attr'" if key in PLUGIN_FIELDS else ""
                raise ValueError(f"{key}={value!r} is not one of {list(allowed)}{plug}")


def plugin_values(cfg: Config) -> list[tuple[str, str, str]]:
    """Every plug-in the config names, as (kind, field, value)."""
    out = []
    if _plugins.is_plugin(cfg.retrieval.backend):
        out.append(("retriever", "retrieval.backend", cfg.retrieval.backend))
    for j, t in enumerate(cfg.protocol.tools):
        if _plugins.is_plugin(t):
            out.append(("tool", f"protocol.tools[{j}]", t))
    for i, st in enumerate(cfg.stages):
        if _plugins.is_plugin(st.reward.name):
            out.append(("reward", f"stages[{i}].reward.name", st.reward.name))
        if _plugins.is_plugin(st.format):
            out.append(("dataset", f"stages[{i}].format", st.format))
        if _plugins.is_plugin(st.algo.name):
            out.append(("algorithm", f"stages[{i}].algo.name", st.algo.name))
    if _plugins.is_plugin(cfg.eval.format):
        out.append(("dataset", "eval.format", cfg.eval.format))
    return out


def _check_plugins(cfg: Config) -> None:
    """``plugins`` holds only the sources of file plug-ins this config names (it is filled at load: a
    source for a file no field names would be code shipped to every process for nothing)."""
    named = {v.rpartition(":")[0] for _, _, v in plugin_values(cfg)}
    stale = sorted(set(cfg.plugins) - named)
    if stale:
        raise ValueError(f"plugins has sources for {stale}, which no plug-in field of this config names; "
                         "plugins is filled at load from the fields' file plug-ins, leave it unset")


def resolve_plugins(cfg: Config) -> Config:
    """Read each file plug-in's source into ``cfg.plugins`` (once: a source already there is kept, so a
    config built on the driver resolves the same in every actor) and load every plug-in, so a missing
    module, file or attribute, or a wrong signature, is refused at load naming the field (idempotent)."""
    found = plugin_values(cfg)
    if not found:
        return cfg
    sources = dict(cfg.plugins)
    for kind, fld, value in found:  # every value here is a plug-in (plugin_values)
        read = None if value.rpartition(":")[0] in sources else _plugins.read_source(value, fld)
        if read is not None:
            sources[read[0]] = read[1]
        _plugins.check(kind, value, fld, sources, PLUGIN_ARITY[kind])
        if kind == "algorithm":
            spec_of(value, fld, sources)  # it carries its AlgoSpec, which the checks and the learner read
    _plugins.remember(sources)
    return cfg if sources == dict(cfg.plugins) else dataclasses.replace(cfg, plugins=sources)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A model directory holds its tokenizer when it has one of these (what ``AutoTokenizer`` reads)."""


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""A ``model.path`` that is no local path and reads ``org/name`` is a Hugging Face Hub id (resolved from the
hub's cache when the run starts: ``actors/model.py``)."""


def _check_model_dir(path: str) -> None:
    """``model.path`` is a Hugging Face model directory: ``config.json`` and a tokenizer (``TOKENIZER_FILES``).
    Refused naming what is missing. The driver reads it to build the policy every role loads, so a path
    missing here is refused too, but by the ``sonar config`` verbs (run where the cluster's storage may be
    out of reach: noted) and for a Hub id (resolved when the run starts)."""
    d = Path(path).expanduser()
    if not d.exists():
        if HUB_ID.match(path) or not_checked(f"model.path={path!r}: not on this machine (its config.json and "
                                             "tokenizer are read where the run starts)"):
            return
        raise ValueError(f"model.path={path!r}: no such directory here, where the run starts and reads the model "
                         "to build the policy every role loads (a Hugging Face model directory, or a Hub id org/name)")
    if not d.is_dir():
        raise ValueError(f"model.path={path!r} is a file; it must be a Hugging Face model directory "
                         "(config.json and the tokenizer's files)")
    missing = [] if (d / "config.json").is_file() else ["config.json"]
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"tokenizer files ({' / '.join(TOKENIZER_FILES)})")
    if missing:
        raise ValueError(f"model.path={path!r} is not a Hugging Face model directory: {' and '.join(missing)} "
                         "missing there (the model's and the tokenizer's save_pretrained write them)")


def _check_model(cfg: Config) -> None:
    _check_choices(cfg, "model")
    m = cfg.model
    if m.path:
        _check_model_dir(m.path)
    if m.tags == "text" and not m.path:
        raise ValueError("model.tags='text' needs model.path (a stock tokenizer): the tiny word-level model's "
                         "tokenizer has every tag as one token of its own vocabulary; use model.tags='auto' or 'special'")
    if m.path is None and m.hidden_size % m.num_heads:  # num_heads >= 1: its range
        raise ValueError(f"model.hidden_size={m.hidden_size} must be a multiple of model.num_heads={m.num_heads}")


def _check_protocol(cfg: Config) -> None:
    _check_choices(cfg, "protocol")
    p = cfg.protocol
    tools = list(p.tools)
    for j, t in enumerate(tools):
        if t not in BUILTIN_NAMES["tool"] and not _plugins.is_plugin(t):
            raise ValueError(f"protocol.tools[{j}]={t!r} is not one of {list(BUILTIN_NAMES['tool'])} nor a tool "
                             "plug-in 'module:attr' / 'file.py:attr'")
    if "search" not in tools:
        raise ValueError(f"protocol.tools={tools!r} must list search: every protocol is a search protocol "
                         "(its budget is protocol.max_turns)")
    if len(set(tools)) != len(tools):
        raise ValueError(f"protocol.tools={tools!r} names a tool twice")
    if p.max_total_tokens > cfg.model.max_position_embeddings and cfg.model.path is None:
        raise ValueError(
            f"protocol.max_total_tokens={p.max_total_tokens} > model.max_position_embeddings={cfg.model.max_position_embeddings}")
    if p.name not in _PROMPT_PROTOCOLS[p.prompt]:
        raise ValueError(f"protocol.prompt={p.prompt!r} describes protocol.name in {list(_PROMPT_PROTOCOLS[p.prompt])}, "
                         f"not protocol.name={p.name!r}")
    need = {"r1_searcher_base": "base", "r1_searcher_instruct": "chat", "r1_searcher_eval": "base"}.get(p.prompt)
    if need and p.template != need:
        raise ValueError(f"protocol.prompt={p.prompt!r} needs protocol.template={need!r}, got protocol.template={p.template!r}")


_PROMPT_PROTOCOLS = {
    "short": ("r1_searcher", "search_r1", "rag_r1", "rag_r1_multi"),
    "r1_searcher_base": ("r1_searcher",),
    "r1_searcher_eval": ("r1_searcher",),
    "r1_searcher_instruct": ("r1_searcher",),
    "search_r1": ("search_r1",),
    "rag_r1": ("rag_r1", "rag_r1_multi"),
}
"""Which protocol.name each protocol.prompt describes (``actors.prompts.PROMPT_PROTOCOLS``, which a test
keeps equal; the wire imports nothing of actors)."""


def _check_retrieval(cfg: Config) -> None:
    _check_choices(cfg, "retrieval")
    r = cfg.retrieval
    if r.rerank != "none" and r.rerank_candidates < r.k:
        raise ValueError(f"retrieval.rerank_candidates={r.rerank_candidates} < retrieval.k={r.k}")
    if r.k < cfg.protocol.docs_per_query:
        raise ValueError(f"retrieval.k={r.k} < protocol.docs_per_query={cfg.protocol.docs_per_query}")
    e = r.elastic
    if e.cloud_id is not None and (not e.cloud_id.strip() or ":" not in e.cloud_id):
        raise ValueError(f"retrieval.elastic.cloud_id={e.cloud_id!r} is not an Elastic Cloud id "
                         "('<deployment name>:<base64 data>'; None: use retrieval.elastic.hosts)")
    h = r.http
    parts = urllib.parse.urlsplit(h.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"retrieval.http.url={redact(h.url)!r} is not an http(s) URL with a host")
    if parts.username or parts.password:
        raise ValueError(f"retrieval.http.url={redact(h.url)!r} holds credentials: put a token in an env var and "
                         "name it in retrieval.http.token_env")
    if h.token_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", h.token_env):
        raise ValueError(f"retrieval.http.token_env={h.token_env!r} is not an environment variable name (it names "
                         "the variable holding the token; the token itself never enters the config)")
    if e.store_vectors and r.rerank != "dense":
        raise ValueError(f"retrieval.elastic.store_vectors=True needs retrieval.rerank='dense' (the vectors are "
                         f"the dense reranker's), got retrieval.rerank={r.rerank!r}")


def _check_rollout(cfg: Config) -> None:
    _check_choices(cfg, "rollout")
    r = cfg.rollout
    if r.continuous_batching and r.engine != "hf":
        raise ValueError(f"rollout.continuous_batching=True needs rollout.engine='hf', got {r.engine!r} "
                         "(the vLLM engine batches continuously by itself)")
    _check_vllm(cfg)
    _check_gpu_placement(cfg)
    lo, hi = pool_bounds(cfg)
    if not lo <= r.num_workers <= hi:
        raise ValueError(f"rollout.min_workers={r.min_workers}, rollout.num_workers={r.num_workers}, "
                         f"rollout.max_workers={r.max_workers}: need min_workers <= num_workers <= max_workers")
    if lo < hi and cfg.cluster.mode != "async":
        raise ValueError(f"rollout.min_workers={lo} < rollout.max_workers={hi} (an elastic pool) needs "
                         f"cluster.mode='async', got {cfg.cluster.mode!r}")
    if r.per_trajectory and not (r.continuous_batching or r.engine == "vllm"):
        raise ValueError(f"rollout.per_trajectory=True needs an engine that batches concurrent calls "
                         f"(rollout.continuous_batching=True or rollout.engine='vllm'), got "
                         f"rollout.engine={r.engine!r}, rollout.continuous_batching={r.continuous_batching}: "
                         "a static engine would run the trajectories one at a time")


def _check_vllm(cfg: Config) -> None:
    """The vLLM engine's fields, and a model directory it could not load (checked where it is cheap:
    config.json and its architectures; whether vLLM implements them is known only after importing vLLM,
    which the engine checks before it starts)."""
    r = cfg.rollout
    if r.tensor_parallel_size > 1 and r.engine != "vllm":
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} needs rollout.engine='vllm', "
                         f"got {r.engine!r}")
    if r.tensor_parallel_size > 1 and r.num_gpus_per_worker < r.tensor_parallel_size:
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} > rollout.num_gpus_per_worker="
                         f"{r.num_gpus_per_worker}: each tensor-parallel rank needs a GPU of its own")
    if r.engine == "vllm" and r.vllm_max_num_batched_tokens:
        gpu, n = r.num_gpus_per_worker > 0, r.vllm_max_num_batched_tokens
        need, why = ((r.max_batch_rows, f"rollout.max_batch_rows={r.max_batch_rows}: at most {n} of the rows could "
                      "decode in one step") if gpu else
                     (cfg.protocol.max_total_tokens, f"protocol.max_total_tokens={cfg.protocol.max_total_tokens}: "
                      "chunked prefill is off on CPU, so the longest prefill must fit one step"))
        if n < need:
            raise ValueError(f"rollout.vllm_max_num_batched_tokens={n} < {why} (0 derives it: "
                             f"{vllm_batched_tokens(cfg)})")
    if r.engine != "vllm" or not cfg.model.path:
        return
    conf = Path(cfg.model.path).expanduser() / "config.json"
    if not conf.is_file():
        if not Path(cfg.model.path).expanduser().exists() and not_checked(
                f"model.path={cfg.model.path!r}: not on this machine (its config.json is read where the run starts)"):
            return
        raise ValueError(f"model.path={cfg.model.path!r} with rollout.engine='vllm': no config.json there, so vLLM "
                         "cannot load it (a Hugging Face model directory is needed)")
    try:
        archs = json.loads(conf.read_text()).get("architectures")
    except (OSError, ValueError) as e:
        raise ValueError(f"model.path={cfg.model.path!r}: {conf} is not readable JSON ({e})") from None
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise ValueError(f"model.path={cfg.model.path!r} with rollout.engine='vllm': {conf} names no "
                         f"'architectures' (got {archs!r}), so vLLM cannot pick a model class")


def _check_gpu_placement(cfg: Config) -> None:
    """NCCL with a CPU rank, and two NCCL ranks on one GPU, fail only once the broadcast group forms:
    refuse them here, naming the fields."""
    L, r = cfg.learner, cfg.rollout
    if cfg.cluster.placement == "colocated":
        return  # no broadcast group: the hand-over (``_check_colocated``)
    if L.dist_backend == "nccl" and (L.num_gpus <= 0 or r.num_gpus_per_worker <= 0):
        raise ValueError(f"learner.dist_backend='nccl' with learner.num_gpus={L.num_gpus} and "
                         f"rollout.num_gpus_per_worker={r.num_gpus_per_worker}: NCCL needs a GPU on every rank of "
                         "the weight broadcast (the learner and each rollout worker); use 'auto' (gloo when a rank "
                         "is on CPU) or 'gloo'")
    if broadcast_backend(cfg) != "nccl":
        return
    shared = {k: v for k, v in (("learner.num_gpus", L.num_gpus), ("rollout.num_gpus_per_worker", r.num_gpus_per_worker))
              if v != int(v)}
    if shared:
        raise ValueError(f"{', '.join(f'{k}={v}' for k, v in shared.items())} with an NCCL weight broadcast: a "
                         "fractional GPU lets Ray put two ranks of the group (the learner and an engine, or two "
                         "engines) on one device, which NCCL refuses; use whole GPUs, learner.dist_backend='gloo', or "
                         "cluster.placement='colocated' (learner and engine take turns on one GPU, weights handed "
                         "over by CUDA IPC)")


def _check_learner(cfg: Config) -> None:
    _check_choices(cfg, "learner")
    L = cfg.learner
    if L.num_gpus > 1:
        raise ValueError(f"learner.num_gpus={L.num_gpus} is per rank and at most 1: one DeepSpeed rank drives one "
                         f"GPU; for {L.num_gpus:g} GPUs set learner.num_ranks={int(math.ceil(L.num_gpus))} and "
                         "learner.num_gpus=1")
    if L.rendezvous == "loopback" and L.num_ranks > 1 and L.placement_strategy != "STRICT_PACK":
        raise ValueError(f"learner.rendezvous='loopback' with learner.num_ranks={L.num_ranks} and "
                         f"learner.placement_strategy={L.placement_strategy!r}: loopback reaches only rank 0's node; "
                         "use STRICT_PACK or rendezvous='auto'")
    if L.offload_optimizer and L.zero_stage < 1:
        raise ValueError(f"learner.offload_optimizer=True with learner.zero_stage={L.zero_stage}: optimizer "
                         "offload is a ZeRO feature (stage 1, 2 or 3)")
    if L.broadcast_every > cfg.replay.max_policy_lag + 1:
        raise ValueError(
            f"learner.broadcast_every={L.broadcast_every} > replay.max_policy_lag+1={cfg.replay.max_policy_lag + 1}: "
            "every trajectory would be stale before the workers saw new weights")
    if L.lora.rank:
        bad = [m for m in L.lora.target_modules if not m.isidentifier()]
        if not L.lora.target_modules or bad:
            raise ValueError(f"learner.lora.target_modules={list(L.lora.target_modules)!r}: name the modules that get "
                             "adapters by their last name component (q_proj, up_proj, ...)"
                             + (f"; not a module name: {bad[0]!r}" if bad else ""))
        if L.zero_stage == 3 and L.logits_chunk_tokens > 0:
            raise ValueError(
                f"learner.lora.rank={L.lora.rank} with learner.zero_stage=3 and learner.logits_chunk_tokens="
                f"{L.logits_chunk_tokens}: once DeepSpeed 0.19.8's zero3_linear_wrap has replaced F.linear in the "
                "learner's process (a ZeRO-3 engine over modules built outside zero.Init does it, the PPO critic's "
                "among them), the frozen output head is not gathered again for a chunk's recomputation and the "
                "step fails; use learner.zero_stage 0-2 (a 7B's LoRA learner fits 40 GB GPUs at ZeRO-2, the memory "
                "plan says), or learner.logits_chunk_tokens=0")
        if cfg.rollout.engine == "vllm" and L.lora.rank > 512:
            raise ValueError(f"learner.lora.rank={L.lora.rank} with rollout.engine='vllm': vLLM serves adapters of rank "
                             "<= 512 (its max_lora_rank)")


def _check_critic(cfg: Config) -> None:
    _check_choices(cfg, "critic")
    for i, st in enumerate(cfg.stages):
        if st.kind == "rl" and st.algo.dynamic_sampling and cfg.rollout.group_size == 1:
            raise ValueError(f"stages[{i}].algo.name={st.algo.name!r} with stages[{i}].algo.dynamic_sampling=True and "
                             f"rollout.group_size=1: a group of one always has all-equal rewards, so dynamic "
                             "sampling would drop every sample (leave it unset: off for ppo)")


def _check_replay(cfg: Config) -> None:
    _check_choices(cfg, "replay")
    q, L, r = cfg.replay, cfg.learner, cfg.rollout
    if q.capacity_groups < L.groups_per_step:
        raise ValueError(
            f"replay.capacity_groups={q.capacity_groups} < learner.groups_per_step={L.groups_per_step}: "
            "the learner could never fill a batch")
    if 0 < q.max_inflight_groups < max(L.groups_per_step, r.groups_per_request):  # >= -1: its range
        raise ValueError(f"replay.max_inflight_groups={q.max_inflight_groups} must be -1 (auto), 0 (unlimited) "
                         f"or >= max(learner.groups_per_step={L.groups_per_step}, "
                         f"rollout.groups_per_request={r.groups_per_request}): a smaller budget could never fill a step")
    # its range is [0, 1] (0 is harmless under drop); under downweight 0 would zero every stale group's loss
    if q.stale_policy == "downweight" and q.stale_downweight == 0:
        raise ValueError(f"replay.stale_downweight={q.stale_downweight} must be in (0, 1] "
                         "with replay.stale_policy='downweight'")


def _check_stages(cfg: Config) -> None:
    if not cfg.stages:
        raise ValueError("stages=[] : a run needs at least one stage")
    for i, stage in enumerate(cfg.stages):
        for key, allowed in _STAGE_CHOICES.items():
            value = _get(stage, key)
            if value not in allowed and not (key in PLUGIN_FIELDS and _plugins.is_plugin(value)):
                plug = " nor a plug-in 'module:attr' / 'file.py:attr'" if key in PLUGIN_FIELDS else ""
                raise ValueError(f"stages[{i}].{key}={value!r} is not one of {list(allowed)}{plug}")
        _check_reward(i, stage.reward)
        d = stage.difficulty
        if len(d) != 2 or d[0] > d[1]:  # each bound in [0, 1]: its range
            raise ValueError(f"stages[{i}].difficulty={list(d)} must be [lo, hi] with 0 <= lo <= hi <= 1")
        a = stage.algo
        spec = spec_of(a.name, f"stages[{i}].algo.name", cfg.plugins)
        if spec.no_std and a.std_normalize:
            raise ValueError(f"stages[{i}].algo.name={a.name!r} with stages[{i}].algo.std_normalize=True: {spec.no_std}")
        rows = cfg.learner.groups_per_step * cfg.rollout.group_size
        if stage.kind == "rl" and a.mini_batches > rows:
            raise ValueError(f"stages[{i}].algo.mini_batches={a.mini_batches} > learner.groups_per_step x "
                             f"rollout.group_size={rows}: a mini-batch needs at least one trajectory")
        if stage.kind == "rl" and spec.groups and cfg.rollout.group_size < 2:
            raise ValueError(f"stages[{i}].algo.name={a.name!r} needs rollout.group_size >= 2, got {cfg.rollout.group_size}")
        _check_data(cfg, f"stages[{i}]", stage.data, stage.format, stage.fields)
        if stage.kind == "sft" and stage.data is not None:
            raise ValueError(f"stages[{i}].kind='sft' with stages[{i}].data={stage.data!r}: SFT demonstrations need "
                             "a gold search plan, which dataset files do not carry; train SFT on the synthetic "
                             "world (data unset) or use an RL stage for the files")
        if stage.kind == "rl" and stage.steps > 0 and cfg.rollout.temperature == 0:
            raise ValueError(f"stages[{i}].kind='rl' with rollout.temperature=0: greedy rollouts have no sampling "
                             "logprobs for the learner to match (use a temperature > 0)")


def _check_reward(i: int, r: RewardConfig) -> None:
    """A stage's reward (its name and variant are checked against ``_STAGE_CHOICES`` first)."""
    if r.variant != "paper" and r.name not in ("r1_stage1", "r1_stage2"):
        raise ValueError(f"stages[{i}].reward.variant={r.variant!r} applies to R1-Searcher's rewards only; "
                         f"stages[{i}].reward.name={r.name!r} has no released variant (use 'paper')")
    if r.variant == "code_qwen" and r.name == "r1_stage1":
        raise ValueError(f"stages[{i}].reward.variant='code_qwen' with stages[{i}].reward.name='r1_stage1': "
                         "R1-Searcher released no Qwen stage-1 server (use 'code_llama' or 'paper')")


def _check_eval(cfg: Config) -> None:
    _check_data(cfg, "eval", cfg.eval.data, cfg.eval.format, cfg.eval.fields)
    _check_world_questions(cfg)


REAL_VOCAB = 1000
"""A ``model.path`` whose config.json has at least this many vocabulary rows is a pretrained model's (a
stock BPE: GPT-2 50,257, Qwen 151,936); Sonar's world tokenizers have a few hundred words."""


def real_model(cfg: Config) -> Optional[str]:
    """Why ``model.path`` names a pretrained model (a Hub id, or a vocabulary >= REAL_VOCAB), or None
    (unset, or a small word-level policy such as a Sonar export of the tiny model)."""
    path = cfg.model.path
    if not path:
        return None
    conf = Path(path).expanduser() / "config.json"
    if not conf.is_file():
        return f"model.path={path!r} (not a local directory here: a Hub id or the cluster's storage)"
    try:
        raw = json.loads(conf.read_text())
        vocab = raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size") or 0
    except (OSError, ValueError, AttributeError):
        return None  # _check_vllm / the loaders report an unreadable config.json
    return f"model.path={path!r} (vocabulary {vocab:,})" if int(vocab) >= REAL_VOCAB else None


def _check_world_questions(cfg: Config) -> None:
    """RL or evaluation on the synthetic world's questions with a real model or corpus: refused unless
    ``world.force`` (see that field)."""
    if cfg.world.force:
        return
    # SFT stages are left out: their demonstrations are always the world's (a gold search plan), and
    # they teach the format, not facts (a tiny policy learns the tags there before RL on the files).
    on_world = [f"stages[{i}]" for i, st in enumerate(cfg.stages)
                if st.kind == "rl" and st.steps > 0 and st.data is None]
    if cfg.eval.data is None:
        on_world.append("eval")
    if not on_world:
        return
    why = [w for w in (f"retrieval.corpus={cfg.retrieval.corpus!r}" if cfg.retrieval.corpus else None,
                       real_model(cfg)) if w]
    if why:
        raise ValueError(f"{', '.join(on_world)} would use the synthetic world's toy questions (stages.N.data / "
                         f"eval.data unset) with {' and '.join(why)}: set stages.N.data and eval.data to your "
                         "dataset files, or world.force=true to train on the toy world anyway")


def data_paths(data: Optional[Union[str, List[str]]]) -> list[str]:
    """``stages.N.data`` / ``eval.data`` as a list of paths ([] when unset)."""
    if data is None:
        return []
    return [data] if isinstance(data, str) else list(data)


DATA_FIELD_KEYS = ("question", "golds", "qid")
"""Keys of ``stages.N.fields`` / ``eval.fields`` (question and golds required)."""


def _check_data(cfg: Config, where: str, data, fmt: str, fields: Optional[dict] = None) -> None:
    """A data field: a format Sonar reads, non-empty existing paths, and a corpus to search them in."""
    if fields:
        bad = sorted(set(fields) - set(DATA_FIELD_KEYS))
        if bad:
            raise ValueError(f"{where}.fields: unknown key(s) {bad}; the keys are {list(DATA_FIELD_KEYS)}")
        need = [k for k in ("question", "golds") if not fields.get(k)]
        if need:
            raise ValueError(f"{where}.fields={dict(fields)!r} names no record key for {need}")
        if fmt != "auto":
            raise ValueError(f"{where}.fields with {where}.format={fmt!r}: a field mapping is its own loader; "
                             "leave the format at auto")
    if fmt not in DATA_FORMATS and not _plugins.is_plugin(fmt):
        raise ValueError(f"{where}.format={fmt!r} is not one of {list(DATA_FORMATS)} nor a dataset plug-in "
                         "'module:attr' / 'file.py:attr'")
    if data is None:
        return
    paths = data_paths(data)
    if not paths:
        raise ValueError(f"{where}.data=[] : name at least one file, or leave it unset for the synthetic world")
    for j, path in enumerate(paths):
        if not path or not Path(path).expanduser().is_file():
            if path and Path(path).is_absolute() and not_checked(f"{where}.data[{j}]={path!r}: not on this machine"):
                continue  # on the cluster's storage, read where the run starts
            raise ValueError(f"{where}.data[{j}]={path!r}: no such file")
    if not cfg.retrieval.corpus and cfg.retrieval.backend != "http":  # an http server holds its own corpus
        raise ValueError(f"{where}.data={data!r} with retrieval.corpus=None: questions from files need the "
                         "passages that answer them (a JSONL corpus, or retrieval.backend=http and a server "
                         "that holds them); the synthetic world's corpus cannot")


def _check_cluster(cfg: Config) -> None:
    _check_choices(cfg, "cluster")
    c = cfg.cluster
    if c.bind_host not in ("auto", "loopback"):
        import ipaddress

        try:
            ipaddress.ip_address(c.bind_host)
        except ValueError:
            raise ValueError(f"cluster.bind_host={c.bind_host!r} is not 'auto', 'loopback' or an IP address") from None
    for role, res in c.role_resources.items():
        if role not in ROLE_NAMES:
            raise ValueError(f"cluster.role_resources.{role}: unknown role (one of {', '.join(ROLE_NAMES)})")
        for name, amount in res.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"cluster.role_resources.{role}.{name}={amount}: CPUs and GPUs are asked for by "
                                 "learner.num_cpus/num_gpus and rollout.num_cpus_per_worker/num_gpus_per_worker")
            if not (math.isfinite(amount) and amount >= 0):
                raise ValueError(f"cluster.role_resources.{role}.{name}={amount} must be finite and >= 0")


def _check_colocated(cfg: Config) -> None:
    """``cluster.placement=colocated``: what taking turns on one device rules out, each refusal naming the
    fields (``ClusterConfig.placement``)."""
    c, L, r = cfg.cluster, cfg.learner, cfg.rollout
    if c.placement != "colocated":
        if L.offload_while_generating:
            raise ValueError("learner.offload_while_generating=True needs cluster.placement='colocated' (in split "
                             f"placement no engine shares the learner's GPU), got {c.placement!r}")
        return
    if c.mode != "sync":
        raise ValueError(f"cluster.placement='colocated' with cluster.mode={c.mode!r}: generation and training take "
                         "turns on one device, so they cannot overlap; use cluster.mode='sync', or "
                         "cluster.placement='split' for asynchronous training")
    if L.broadcast_every != 1:
        raise ValueError(f"cluster.placement='colocated' with learner.broadcast_every={L.broadcast_every}: the "
                         "engines wake with the weights of the step just trained (every step hands them over); "
                         "set learner.broadcast_every=1")
    # (an elastic pool needs async mode: refused by the rollout checks already)
    if L.dist_backend == "nccl":
        raise ValueError("cluster.placement='colocated' with learner.dist_backend='nccl': the weights do not "
                         "cross a broadcast group (NCCL refuses two ranks on one GPU); they are handed over on "
                         "the device (leave learner.dist_backend='auto')")
    if L.offload_while_generating and L.zero_stage < 1:
        raise ValueError(f"learner.offload_while_generating=True with learner.zero_stage={L.zero_stage}: DeepSpeed "
                         "moves the states of a ZeRO optimizer only (stage 1, 2 or 3)")
    gpu = L.num_gpus > 0 or r.num_gpus_per_worker > 0
    if not gpu:
        return
    if L.num_gpus != 1 or r.num_gpus_per_worker != 1:
        raise ValueError(f"cluster.placement='colocated' with learner.num_gpus={L.num_gpus:g} and "
                         f"rollout.num_gpus_per_worker={r.num_gpus_per_worker:g}: each learner rank and its "
                         "engine share one whole GPU, so set both to 1 (the placement gives each half of it in "
                         "Ray's accounting)")
    if r.tensor_parallel_size != 1:
        raise ValueError(f"cluster.placement='colocated' with rollout.tensor_parallel_size={r.tensor_parallel_size}:"
                         " each engine shares the GPU of one learner rank (tensor parallelism across colocated "
                         "GPUs is not supported yet); use 1")
    if r.num_workers != L.num_ranks:
        raise ValueError(f"cluster.placement='colocated' with rollout.num_workers={r.num_workers} and "
                         f"learner.num_ranks={L.num_ranks}: one engine per learner rank, on its GPU; set "
                         f"rollout.num_workers={L.num_ranks}")
    if r.engine != "vllm":
        raise ValueError(f"cluster.placement='colocated' on GPUs with rollout.engine={r.engine!r}: the engine "
                         "must free the GPU while the learner trains (vLLM's sleep mode); use rollout.engine='vllm'")


def _check_tracking(cfg: Config) -> None:
    t = cfg.tracking
    if t.experiment is not None and not t.experiment.strip():
        raise ValueError(f"tracking.experiment={t.experiment!r} must be a non-empty name (or null: MLFLOW_EXPERIMENT_NAME, else 'sonar')")
    name = t.registered_model_name
    if name and (name != name.strip() or any(c in name for c in "/:%")):
        raise ValueError(f"tracking.registered_model_name={name!r} must have no surrounding spaces and no '/', ':' or '%'")
    if name and not t.log_model:
        raise ValueError(f"tracking.registered_model_name={name!r} needs tracking.log_model=true (got false)")


def _check_run(cfg: Config) -> None:
    name = cfg.run.name
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"run.name={name!r} must be one path component (no '/', '\\' or NUL, not '.' or "
                         f"'..'): it names a directory under run.root and must not leave it")
    if not Path(cfg.run.root).is_absolute():
        raise ValueError(f"run.root={cfg.run.root!r} must be absolute once loaded (load_config resolves it; "
                         f"pass a config through load_config or resolve_paths)")


_SCHEMA = None


def _schema():
    """A fresh ``OmegaConf.structured(Config)``: built once per process and deep-copied (4 ms instead of
    27 ms; ``load_config`` needs two, and the test suite loads thousands of configs)."""
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = OmegaConf.structured(Config)
    return copy.deepcopy(_SCHEMA)


def load_config(paths: Sequence[str | Path] = (), overrides: Sequence[str] = (), notes: Optional[list] = None) -> Config:
    """Schema <- YAML files (in order) <- CLI dotlist -> validated frozen Config.

    How files compose: mappings merge key by key, later files win; a list (``stages``, ``learner.betas``)
    is replaced whole by the later file's. So two files that both set ``stages`` would silently drop the
    first file's stages and their algorithms: that is refused, naming both files (set the stages in one
    file and size the run with the other, or change single fields with ``stages.N.key=value``).
    ``notes``: collect what could not be checked on this machine instead of failing (``validate``)."""
    merged = _schema()
    staged: Optional[Path] = None  # the file whose stages list is in ``merged``
    for p in paths:
        try:
            p = find_config(p)  # a file, or a shipped preset by name (`tiny`, `configs/smoke.yaml`)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        node = _load_yaml(p)
        if "stages" in node:
            if staged is not None:
                raise ConfigError(
                    f"{staged} and {p} both set stages: a later file's stages list replaces the earlier one whole "
                    f"(lists are not merged), so the stages of {staged.name} and their algorithms and rewards would "
                    f"be dropped; set the stages in one of the files (a sizing overlay such as gpu.yaml sets none) "
                    f"or change single fields on the command line (stages.N.key=value)")
            staged = p
        try:
            merged = OmegaConf.merge(merged, node)
        except OmegaConfBaseException as e:
            raise ConfigError(f"{p}: {_explain(e)}") from None
    # Overrides are applied to a plain copy and merged back into the schema, which re-checks every
    # key and type. (A dotlist merge cannot index into lists: ``stages.1.steps=40``.)
    plain = OmegaConf.to_container(merged)
    for o in overrides:
        key, eq, raw = o.partition("=")
        if not eq:
            raise ConfigError(f"override {o!r} is not of the form key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {o!r}: value is not valid YAML: {_one_line(e)}") from None
        _set_path(plain, key.strip(), value, o)
    _refuse_secret_env(plain)
    try:
        obj = OmegaConf.to_object(OmegaConf.merge(_schema(), plain))
    except OmegaConfBaseException as e:
        raise ConfigError(f"command line: {_explain(e, [o.partition('=')[0].strip() for o in overrides])}") from None
    return validate(resolve_paths(obj), notes=notes)


_NOTED: set = set()


def resolve_paths(cfg: Config, environ: Optional[dict] = None, cwd: Optional[str] = None) -> Config:
    """``run.root``, a relative ``run.run_dir`` and a relative ``retrieval.index_dir`` made absolute
    (``paths.resolve_run_root``: never Ray's temporary package folder). Idempotent."""
    import logging
    import os

    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    root, note = resolve_run_root(cfg.run.root, environ, cwd)
    if note and note not in _NOTED:  # once per process
        _NOTED.add(note)
        logging.getLogger("sonar").warning(note)
    run = dataclasses.replace(cfg.run, root=str(root), run_dir=resolve_relative(cfg.run.run_dir, environ, cwd))
    retrieval = dataclasses.replace(cfg.retrieval, index_dir=resolve_relative(cfg.retrieval.index_dir, environ, cwd))
    return dataclasses.replace(cfg, run=run, retrieval=retrieval)


MAX_YAML_NODES = 10_000
"""Bound on a config file's YAML nodes after alias expansion (an alias bomb is refused, not expanded);
passed to OmegaConf explicitly, so ``OMEGACONF_MAX_YAML_EXPANDED_NODES`` cannot lift it."""


def _load_yaml(p: Path) -> DictConfig:
    """One config file, safely (OmegaConf's safe loader: no ``!!python/...`` tags, aliases bounded by
    :data:`MAX_YAML_NODES`). Anything wrong with it is one line of :class:`ConfigError` naming the file."""
    try:
        node = OmegaConf.load(p, max_yaml_expanded_nodes=MAX_YAML_NODES)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e)
        if "expansion exceeds" in what:  # OmegaConf's alias bound: its advice (an env var) does not apply here
            what = f"more than {MAX_YAML_NODES} nodes after alias expansion (an alias bomb?); refused"
        raise ConfigError(f"{p}: invalid YAML{where}: {_one_line(what)}") from None
    except RecursionError:
        raise ConfigError(f"{p}: invalid YAML: nested too deeply") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read ({_one_line(str(e))})") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (run:, learner:, stages:, ...), "
                          f"got a {'list' if isinstance(node, ListConfig) else type(node).__name__}")
    return node


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _set_path(node: Any, key: str, value: Any, override: str) -> None:
    parts = key.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {override!r}: {'.'.join(parts[:i])} has {len(node)} entries, "
                                  f"no index {part!r}")
            part = int(part)
            if last:
                node[part] = value
            else:
                node = node[part]
        else:
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})


PEER_NAMES = {
    # veRL (verl/trainer/config/ppo_trainer.yaml: the dotted keys) and OpenRLHF (its CLI flags) -> Sonar's
    "rollout.n": "rollout.group_size", "actor_rollout_ref.rollout.n": "rollout.group_size",
    "n_samples_per_prompt": "rollout.group_size",
    "learner.lr": "stages.N.lr", "actor_rollout_ref.actor.optim.lr": "stages.N.lr", "actor_learning_rate": "stages.N.lr",
    "data.train_batch_size": "learner.groups_per_step (prompts per step; each a group of rollout.group_size)",
    "rollout_batch_size": "learner.groups_per_step (prompts per step; each a group of rollout.group_size)",
    "algorithm.adv_estimator": "stages.N.algo.name", "advantage_estimator": "stages.N.algo.name",
    "actor_rollout_ref.actor.ppo_epochs": "stages.N.algo.ppo_epochs", "max_epochs": "stages.N.algo.ppo_epochs",
    "algorithm.kl_ctrl.kl_coef": "stages.N.algo.kl_coef", "init_kl_coef": "stages.N.algo.kl_coef",
    "actor_rollout_ref.model.path": "model.path", "pretrain": "model.path",
    "trainer.total_training_steps": "stages.N.steps",
    "data.max_response_length": "protocol.max_new_tokens_per_turn",
    "generate_max_len": "protocol.max_new_tokens_per_turn",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "vllm_num_engines": "rollout.num_workers", "vllm_tensor_parallel_size": "rollout.tensor_parallel_size",
}
"""The names users of veRL and OpenRLHF type, and Sonar's field for each: an unknown key that is one of them
is answered with Sonar's name (the one table of them)."""


def _explain(e: OmegaConfBaseException, keys: Sequence[str] = ()) -> str:
    """One line: the key, OmegaConf's message (it suggests the field a typo meant), and Sonar's name for a
    veRL or OpenRLHF one (``PEER_NAMES``; ``keys``: the overrides given, the first unknown part of which is
    what OmegaConf names)."""
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    if not key:
        return msg
    given = [k for k in keys if k == key or k.startswith(key + ".")] or [key]
    hint = next((PEER_NAMES.get(k) or PEER_NAMES.get(k.rsplit(".", 1)[-1]) for k in given
                 if PEER_NAMES.get(k) or PEER_NAMES.get(k.rsplit(".", 1)[-1])), None)
    return f"key {key!r}: {msg}" + (f" (Sonar's name: {hint})" if hint else "")


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    """The resolved config as saved beside the run and logged to MLflow (URL credentials redacted)."""
    return redact(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


from sonar.cluster.wire.redact import ENV_INTERPOLATION, SECRET_FIELD, redact  # noqa: E402  (the one redaction)


def _refuse_secret_env(node: Any, path: str = "") -> None:
    """``${oc.env:...}`` into a secret-looking field (``redact.SECRET_FIELD``) is refused: resolved, it
    would copy an environment secret into ``config.yaml`` and the MLflow params. Secrets stay in the
    environment, named by the ``*_env`` fields and read where they are used."""
    if isinstance(node, dict):
        for k, v in node.items():
            _refuse_secret_env(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _refuse_secret_env(v, f"{path}.{i}")
    elif isinstance(node, str) and ENV_INTERPOLATION.search(node) and SECRET_FIELD.search(path.rsplit(".", 1)[-1]):
        raise ConfigError(f"{path}={node!r}: environment interpolation into a secret-looking field is refused "
                          f"(it would be written to config.yaml and MLflow); keep the secret in the environment")


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """Flattened params for MLflow (lists become JSON strings; credentials in URLs redacted)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for i, item in enumerate(v):
                out.update(flatten(item, f"{key}.{i}."))
        else:
            out[key] = redact(json.dumps(v) if isinstance(v, (list, tuple)) else str(v))
    return out
