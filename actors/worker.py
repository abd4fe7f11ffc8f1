"""The rollout worker: a thin Ray actor around an engine and ``rollout_groups``.

It owns one generation engine and runs the rollout loop in a background thread:
claim prompts -> ``rollout_groups`` (generate/search/inject) -> put each finished group into the
replay queue (blocking while it is full: backpressure). Weights arrive on the broadcast group through
``receive_weights`` (an actor method, so it runs while the loop thread generates) into one staging copy
for the HF engines, which ``SwappingEngine`` installs at the start of the next ``generate`` call, so
weights never change inside a forward pass and every MODEL segment carries the version that sampled it;
the vLLM engine streams them into its model instead, with generation paused (``engine_vllm``).

Create with ``ray.remote(RolloutWorker)``; the class itself does not import Ray at module level so it
can be unit-tested in-process.
"""
from __future__ import annotations

from sonar.cluster.wire.bootstrap import role_process

role_process()  # first: in an actor's process, its thread and hub settings before torch and transformers load

import asyncio
import os
import threading
import time
import traceback
from typing import Sequence

import numpy as np

from sonar.actors.engine import Engine, Generation, SamplingParams
from sonar.cluster.wire.config import Config, StageConfig
from sonar.cluster.wire.policy import load_policy, with_lora
from sonar.cluster.wire.protocol import Trajectory, encode_group, group_min_version
from sonar.cluster.wire.startup import startup_without_gc


class SwappingEngine:
    """Engine proxy that installs staged weights between generate calls (never during one).

    The receiver of the engines that take tensors from this actor (the HF and continuous engines): a
    push lands in one *staging set* (one flat buffer per bucket, a full copy of the model on the
    group's device, allocated at the first push of a group and reused by every later one) while the
    loop thread keeps generating, and the copy into the model waits for the next ``generate`` call.
    That staging copy is this path's design (a full-model copy in host memory beside a CPU model);
    engines that stream into the model (vLLM, ``receives_weights``) keep no copy.

    One lock guards the set: a receive holds it while it writes and withdraws what was staged first
    (those bytes are about to be overwritten); an install holds it while it copies into the model.
    ``generate`` does not wait for a receive in progress: it runs on the installed weights and the new
    version is installed at the next call. ``apply_staged()`` (evaluation, sync mode) does wait.
    """

    def __init__(self, inner: Engine):
        self.inner = inner
        self._staged: tuple[int, dict] | None = None
        self._lock = threading.Lock()
        self.buffers: list = []
        """The staging set (``BroadcastGroup.alloc_buffers``), filled by ``RolloutWorker.receive_weights``."""
        self.buffer_lock = threading.Lock()
        self.asleep = False
        """Colocated placement: the engine sleeps while the learner trains on its device (``RolloutWorker.sleep``);
        a generate call then is a bug of the driver's phase order, and raises."""

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def next_version(self) -> int:
        """The version the next generation samples from: staged weights are installed before it."""
        with self._lock:
            staged = self._staged
        return self.inner.version if staged is None else max(staged[0], self.inner.version)

    def stage(self, version: int, tensors: dict, buffer_set: int = -1) -> None:
        """Stage ``tensors`` (views into the staging set, or tensors of the caller's) as ``version``.
        ``buffer_set``: kept for callers of the two-set version; ignored."""
        with self._lock:
            self._staged = (version, tensors)

    def withdraw(self) -> None:
        """Drop what is staged without installing it (a receive is about to overwrite the staging set)."""
        with self._lock:
            self._staged = None

    def apply_staged(self, block: bool = True) -> None:
        """Install staged weights; an engine that receives weights itself (``receives_weights``) is
        waited for instead, until its last received version is loaded. ``block=False``: return at once
        if a receive is writing the staging set (there is nothing complete to install)."""
        if receives_weights(self.inner):
            self.inner.apply_staged()
            return
        if not self.buffer_lock.acquire(blocking=block):
            return
        try:
            with self._lock:
                staged, self._staged = self._staged, None
            if staged is not None:
                self.inner.load_weights(staged[1].items(), staged[0])
        finally:
            self.buffer_lock.release()

    def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                 max_new_tokens_per_prompt: Sequence[int] | None = None) -> list[Generation]:
        if self.asleep:
            raise RuntimeError("generate on a sleeping engine: in colocated placement the learner is training on "
                               "this device (the driver wakes the engines before it asks for rollouts)")
        self.apply_staged(block=False)
        return self.inner.generate(prompts, params, max_new_tokens_per_prompt)

    def load_weights(self, named_tensors, version: int) -> None:
        self.inner.load_weights(named_tensors, version)

    def parameter_specs(self):
        return self.inner.parameter_specs()

    def state_checksum(self) -> float:
        return self.inner.state_checksum()


def receives_weights(engine) -> bool:
    """True for an engine that joins the broadcast group itself (the vLLM engine: inside its own worker
    processes, one rank per tensor-parallel rank) instead of taking tensors from this actor. It offers
    ``broadcast_ranks()``, ``setup_broadcast(addr, port, rank_base, world_size, backend, prefix, sender_specs)``,
    ``receive_weights(version)``, ``apply_staged()`` and ``weights_checksum()``."""
    return callable(getattr(engine, "receive_weights", None)) and callable(getattr(engine, "weights_checksum", None))


def _set_threads(n: int = 1) -> None:
    os.environ["OMP_NUM_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)


class RolloutWorker:
    """The rollout actor (module docstring). ``engine_wrap`` goes to ``build_engine`` (``actors/engines.py``):
    the hook through which code outside production (the benchmarks' simulators) wraps or replaces the
    engine; it crosses into the actor, so it must be picklable. None: the production engine as is."""

    @startup_without_gc()  # transformers' or vLLM's imports and the policy load (cluster/wire/startup.py)
    def __init__(self, worker_id: int, cfg: Config, retriever, *, policy: str, eval_retriever=None,
                 engine_wrap=None):
        """``retriever``: what the rollout loop searches through, injected by the driver (the retrieval
        service's client: it holds Ray actor handles and pickles); sync ``batch_search`` and/or async
        ``abatch_search``. ``eval_retriever``: the same for ``evaluate`` (the driver gives it a bound
        that load cannot reach, so a measurement never counts a timed-out search); None: ``retriever``.
        ``policy``: the Hugging Face directory of the run's initial policy."""
        _set_threads(1)
        from sonar.actors.engines import build_engine
        from sonar.actors.prompts import get_protocol
        from sonar.actors.world import build_world

        from sonar.actors.tools import build_tools
        from sonar.cluster.wire.plugins import remember

        self.worker_id = worker_id
        self.cfg = cfg
        remember(cfg.plugins)  # file plug-ins (rewards, tools, datasets) travel in the config
        self.tools = build_tools(cfg)
        self.world = build_world(cfg.world)
        # vLLM loads the weights itself; the worker needs only the parameter layout (meta tensors).
        model, self.tokenizer = load_policy(policy, weights=cfg.rollout.engine != "vllm")
        if cfg.learner.lora.rank:  # the learner's adapters on the same frozen base: a push moves only them
            model = with_lora(model, cfg.learner.lora, cfg.run.seed)
        self.tags = get_protocol(cfg.protocol.name)
        self.engine = SwappingEngine(build_engine(cfg, model, self.tokenizer, worker_id=worker_id, wrap=engine_wrap,
                                                  policy_dir=policy))
        if retriever is None:
            raise ValueError(f"rollout worker {worker_id} needs a retriever (the driver passes the retrieval client)")
        self.retriever = retriever
        self.eval_retriever = retriever if eval_retriever is None else eval_retriever
        self._group = None
        self._buckets = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: str | None = None
        self._last_progress = time.monotonic()
        self._stats = {"groups": 0, "trajectories": 0, "model_tokens": 0, "searches": 0, "gen_s": 0.0,
                       "retrieve_s": 0.0, "requeued": 0, "busy_s": 0.0}
        self._working, self._busy_since = 0, 0.0  # claimed requests in flight; when the count left 0
        from sonar.actors.rollout import OffEngine

        self._off_engine = OffEngine()  # rows off the engine, reported with each claim and put (engine capacity)
        self._lock = threading.Lock()
        self._data_cache: dict = {}
        """(data paths, format) -> the questions of those files (``_train_questions``)."""

    # ------------------------------------------------------------------ wiring
    def ready(self) -> dict:
        from sonar.cluster.wire.paths import code_origin

        return {"worker_id": self.worker_id, "pid": os.getpid(), "version": self.engine.version,
                "num_params": sum(int(np.prod(s.shape)) for s in self.engine.parameter_specs()),
                "code": code_origin()}

    def replace_retrieval_replica(self, slot: int, handle) -> int:
        """The driver replaced retrieval replica ``slot`` (dead for good) with ``handle``: every retriever
        this worker holds that keeps replica handles (the service's client) searches through it from
        now on. Returns how many retrievers took it."""
        took = 0
        for r in {id(x): x for x in (self.retriever, self.eval_retriever)}.values():
            if hasattr(r, "replace_replica"):
                r.replace_replica(slot, handle)
                took += 1
        return took

    def broadcast_ranks(self) -> int:
        """Ranks this worker takes in the broadcast group (the driver numbers them consecutively)."""
        inner = self.engine.inner
        return int(inner.broadcast_ranks()) if receives_weights(inner) else 1

    def setup_broadcast(self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str,
                        prefix: str, sender_specs: list | None = None) -> str:
        """Join the group as ``rank`` (the first of ``broadcast_ranks()``); returns the layout digest.
        ``sender_specs``: the learner's tensor specs; the buckets take their dtypes (``wire_layout``:
        names and shapes must be this engine's). None: this engine's own specs."""
        from sonar.cluster.transport.weights import BroadcastGroup, TensorSpec, layout_digest, plan_buckets, wire_layout

        timeout_s = self.cfg.cluster.broadcast_timeout()  # every wait of a push: a dead learner raises within it
        if receives_weights(self.engine.inner):
            return self.engine.inner.setup_broadcast(master_addr, master_port, rank, world_size, backend, prefix,
                                                     sender_specs, timeout_s=timeout_s)
        specs = [TensorSpec(p.name, tuple(p.shape), p.dtype) for p in self.engine.parameter_specs()]
        if sender_specs is not None:
            specs = wire_layout(specs, sender_specs)
        self._group = BroadcastGroup(master_addr, master_port, rank, world_size, backend, prefix=prefix,
                                     timeout_s=timeout_s)
        self._buckets = plan_buckets(specs)
        self.engine.apply_staged()  # nothing may still point into buffers of a previous group
        with self.engine.buffer_lock:
            self.engine.buffers = []
        return layout_digest(specs)

    def receive_weights(self, version: int) -> dict:
        """Collective with the learner's push. vLLM: streamed into the model (the engine pauses, loads as
        the buckets arrive, resumes). Other engines: into the one staging set while the loop thread keeps
        generating; installed at the next generate call (``SwappingEngine``)."""
        t0 = time.perf_counter()
        if receives_weights(self.engine.inner):  # the bytes go straight into vLLM's workers; it loads them
            out = self.engine.inner.receive_weights(version)
            return {"worker_id": self.worker_id, "version": version, "recv_s": time.perf_counter() - t0,
                    "pause_s": out.get("pause_s", 0.0)}
        with self.engine.buffer_lock:
            self.engine.withdraw()  # the staged version's bytes are about to be overwritten
            if not self.engine.buffers:
                self.engine.buffers = self._group.alloc_buffers(self._buckets)
            tensors = self._group.recv_weights(self._buckets, into=self.engine.buffers)
            self.engine.stage(version, tensors)
        return {"worker_id": self.worker_id, "version": version, "recv_s": time.perf_counter() - t0}

    def sleep(self, level: int) -> dict:
        """Colocated placement: the learner is about to train on this worker's device. The engine frees it
        (``rollout.sleep_level``: vLLM's sleep mode; the HF engine moves its model to host memory; nothing
        to free on CPU, ``freed`` False) and refuses to generate until :meth:`wake`. Nothing runs here then:
        the sync loop asks for a batch only between a wake and a sleep."""
        self.engine.apply_staged()  # a push received earlier goes in now, not into a sleeping engine
        self.engine.asleep = True
        inner = self.engine.inner
        out = inner.sleep(int(level)) if callable(getattr(inner, "sleep", None)) else {"seconds": 0.0, "freed": False}
        return {"worker_id": self.worker_id, **out}

    def wake(self, tags: list | None = None) -> dict:
        """Undo :meth:`sleep` for ``tags`` (vLLM: ``["weights"]`` before the hand-over, so the push loads into
        resident weights, then ``["kv_cache"]``; None: both). The engine generates again once the KV
        cache is back (``tags`` None or containing ``kv_cache``)."""
        inner = self.engine.inner
        out = inner.wake_up(tags) if callable(getattr(inner, "wake_up", None)) else {"seconds": 0.0}
        if tags is None or "kv_cache" in tags:
            self.engine.asleep = False
        return {"worker_id": self.worker_id, **out}

    def apply_staged_weights(self) -> int:
        self.engine.apply_staged()
        return self.engine.version

    def engine_stats(self) -> dict:
        """The engine's own counters (``engine_stats()``) where it keeps any, else just its type name."""
        inner = self.engine.inner
        return inner.engine_stats() if hasattr(inner, "engine_stats") else {"engine": type(inner).__name__}

    def checksum(self) -> dict:
        """Same function as the learner's (cluster.weights.checksum), so the two can be compared."""
        from sonar.cluster.transport.weights import checksum

        inner = self.engine.inner
        if receives_weights(inner):  # the weights live in the engine's own processes: it sums what they received
            return dict(inner.weights_checksum())
        # over what a push moves (``parameter_specs``: the trainable tensors; with LoRA the adapters)
        return {"version": self.engine.version,
                "checksum": checksum((n, p) for n, p in inner.model.named_parameters() if p.requires_grad)}

    # ------------------------------------------------------------------ rollout loop
    def start(self, replay, stage_index: int, stage: StageConfig) -> bool:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"worker {self.worker_id}: rollout loop already running")
        self._stop.clear()
        self._error = None
        # Idle time (health()'s idle_s, judged against cluster.step_timeout_s) counts from this loop's start:
        # an SFT stage, an evaluation or a regroup before it is not a stall of this loop.
        self._last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._loop, args=(replay, stage_index, stage), daemon=True,
                                        name=f"rollout-{self.worker_id}")
        self._thread.start()
        return True

    def stop(self, timeout_s: float = 120.0) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"worker {self.worker_id}: rollout loop did not stop within {timeout_s}s")
        return self.health()

    def _work(self, delta: int) -> None:
        """A claimed request starts (+1) or ends (-1): ``busy_s`` counts the seconds with at least one in
        flight, the rollout side's measured busy time (``reports.SplitMeter`` turns it into idle shares)."""
        with self._lock:
            now = time.monotonic()
            if delta > 0 and self._working == 0:
                self._busy_since = now
            self._working += delta
            if delta < 0 and self._working == 0:
                self._stats["busy_s"] += now - self._busy_since

    def health(self) -> dict:
        with self._lock:
            stats = dict(self._stats)
            if self._working:  # the busy period in progress counts up to now
                stats["busy_s"] += time.monotonic() - self._busy_since
        alive = self._thread is not None and self._thread.is_alive()
        return {"worker_id": self.worker_id, "alive": alive, "error": self._error,
                "idle_s": time.monotonic() - self._last_progress, "version": self.engine.version,
                "stats": stats}

    def _loop(self, replay, stage_index: int, stage: StageConfig) -> None:
        """Keep up to ``rollout.batches_in_flight`` batches going: while one waits on retrieval, another
        generates (a static engine serialises the generate calls; a continuous one batches them together).
        The replay's admission budget (``replay.max_inflight_groups``) decides how many actually run."""

        async def lane(lane_id: int) -> None:
            batch_no = lane_id
            while not self._stop.is_set():
                await _aproduce(self, replay, stage_index, stage, self.cfg.rollout.groups_per_request, batch_no)
                batch_no += self.cfg.rollout.batches_in_flight

        async def lanes() -> None:
            await asyncio.gather(*(lane(i) for i in range(self.cfg.rollout.batches_in_flight)))

        try:
            asyncio.run(lanes())
        except Exception:  # reported through health(); the driver restarts or fails the run
            self._error = traceback.format_exc(limit=20)

    def generate_groups(self, replay, stage_index: int, stage: StageConfig, n_groups: int, batch_no: int) -> dict:
        """Synchronous mode: produce exactly ``n_groups`` groups with the current weights, then return.
        The whole share is submitted at once, as veRL's synchronous trainer does: every request of
        ``groups_per_request`` groups starts now, with no ``batches_in_flight`` cap (the lanes are how
        async mode runs ahead; a step's batch has nothing to run ahead of), so the engine's
        ``max_batch_rows`` bounds the rows in flight here as it does in async mode; with
        ``rollout.per_trajectory`` every trajectory is its own coroutine, as in async mode. The two
        modes then differ only in overlap with training and the staleness bound."""
        self.engine.apply_staged()
        t0 = time.perf_counter()
        per = self.cfg.rollout.groups_per_request
        sizes = [min(per, n_groups - s) for s in range(0, n_groups, per)]

        async def one(j: int, n: int) -> None:
            await _aproduce(self, replay, stage_index, stage, n, batch_no * 1000 + j)

        async def all_() -> None:
            await asyncio.gather(*(one(j, n) for j, n in enumerate(sizes)))

        asyncio.run(all_())
        return {"worker_id": self.worker_id, "groups": sum(sizes), "seconds": time.perf_counter() - t0}

    def _prompt_item(self, index: int, stage: StageConfig | None = None):
        """Training question ``index`` of ``stage``: of its data files (``stages.N.data``), else of the world."""
        from sonar.actors.rollout import PromptItem

        q = self._train_questions(stage)[index]
        return PromptItem(prompt_id=q.qid, question=q.question, golds=list(q.golds), meta=dict(q.meta))

    def _train_questions(self, stage: StageConfig | None) -> list:
        """The stage's training questions, in the order the driver counted them (``load_datasets`` of
        ``stage.data``, loaded once per worker and stage data); the world's when ``data`` is unset."""
        if stage is None or stage.data is None:
            return self.world.train
        from sonar.actors.datasets import load_datasets
        from sonar.cluster.wire.config import data_paths

        key = (tuple(data_paths(stage.data)), stage.format, tuple(sorted(stage.fields.items())))
        if key not in self._data_cache:
            self._data_cache[key] = load_datasets(list(key[0]), fmt=stage.format, fields=dict(stage.fields))
        return self._data_cache[key]

    def _record(self, group: list[Trajectory], ok: bool) -> None:
        with self._lock:
            if not ok:
                self._stats["requeued"] += 1
                return
            self._stats["groups"] += 1
            self._stats["trajectories"] += len(group)
            for t in group:
                self._stats["model_tokens"] += t.num_model_tokens()
                self._stats["searches"] += len(t.searches)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, questions: list[dict], search_enabled: bool, stage: StageConfig) -> list[dict]:
        """Greedy rollouts over the given questions (``actors/evaluation.py``, the one evaluation
        path); returns one record per question, with its scores and the trace."""
        from sonar.actors.evaluation import greedy_records
        from sonar.actors.rollout import PromptItem

        self.engine.apply_staged()
        items = [PromptItem(prompt_id=q["qid"], question=q["question"], golds=list(q["golds"]), meta=dict(q.get("meta") or {}))
                 for q in questions]
        return asyncio.run(greedy_records(
            items, engine=self.engine, retriever=self.eval_retriever, tokenizer=self.tokenizer, tags=self.tags,
            proto=self.cfg.protocol, k=self.cfg.retrieval.k, reward=stage.reward, batch_size=self.cfg.eval.batch_size,
            search_enabled=search_enabled, actor_id=self.worker_id, tools=self.tools))


def rollout_records(group: list[Trajectory]) -> list[dict]:
    """What the rollout metrics read of each trajectory (``cluster/driver/reports.rollout_metrics``); they
    travel to the driver with the group, through the replay (``ReplayQueue.report``)."""
    return [{"reward": t.reward, "parts": dict(t.reward_parts), "finish": t.finish_reason,
             "searches": len(t.searches), "failed_searches": sum(1 for s in t.searches if s.error),
             "latency_ms": [s.latency_ms for s in t.searches],
             "tool_calls": {c.tool: sum(1 for d in t.tool_calls if d.tool == c.tool) for c in t.tool_calls},
             "model_tokens": t.num_model_tokens()} for t in group]


INFRA_ERRORS = frozenset({"timeout", "connection", "internal", "http_5xx", "http_429", "breaker_open"})
"""Search errors of the infrastructure, not of the query (``RetrievalError.KINDS`` less ``bad_request``)."""


def infra_failed(group: list[Trajectory]) -> bool:
    """Whether any search of the group failed for infrastructure reasons (``INFRA_ERRORS``)."""
    return any(s.error in INFRA_ERRORS for t in group for s in t.searches)


# Coroutines live outside the actor class: one `async def` method would turn the Ray actor into an
# asyncio actor, whose event loop then forbids the asyncio.run() of the synchronous methods.
async def _aproduce(w: "RolloutWorker", replay, stage_index: int, stage: StageConfig, n: int, batch_no: int) -> None:
    """Claim n prompts, roll out one group each, put every group into the replay queue."""
    seed = w.cfg.run.seed * 1_000_003 + w.worker_id * 7919 + batch_no
    # Waits at most 1 s for the admission budget (async mode), then returns so the lane sees a stop.
    # The claim names the policy version these groups start from: the replay admits them only if the
    # learner will take them while that version is fresh (replay.py, version-aware admission).
    # It reports its rows now off the engine (on a tool, or done before their group): they leave room for more.
    idx = await asyncio.wrap_future(replay.claim.remote(w.worker_id, n, 1.0, w.engine.next_version,
                                                        w._off_engine.rows).future())
    if not idx:
        w._last_progress = time.monotonic()  # alive, held back by the budget (the learner is behind)
        await asyncio.sleep(0.05)  # a closed queue answers at once: do not spin on it
        return
    w._work(+1)
    try:
        await _produce_claimed(w, replay, stage_index, stage, idx, seed)
    finally:
        w._work(-1)
    w._last_progress = time.monotonic()


async def _produce_claimed(w: "RolloutWorker", replay, stage_index: int, stage: StageConfig, idx: list[int],
                           seed: int) -> None:
    """Roll out the claimed prompts ``idx`` and hand each group to the replay (or requeue it)."""
    items = [w._prompt_item(i, stage) for i in idx]

    async def hand_off(j: int, group: list[Trajectory]) -> None:
        i = idx[j]
        if w.cfg.cluster.requeue_failed_searches and infra_failed(group):
            # A search failed for infrastructure reasons (dead replica, timeout...): not trained, and
            # the prompt goes back to the replay's cursor (cluster.requeue_failed_searches).
            await asyncio.wrap_future(replay.requeue.remote(w.worker_id, i).future())
            with w._lock:
                w._stats["requeued_infra"] = w._stats.get("requeued_infra", 0) + 1
            return
        searched = any(s.error is None for t in group for s in t.searches)  # retrieval answered (an outage ends)
        ok = await asyncio.wrap_future(replay.put.remote(
            encode_group(group), group_min_version(group), len(group), i, w.worker_id, searched,
            w._off_engine.rows, rollout_records(group)).future())
        w._record(group, ok)

    # Per trajectory, each group is handed off as soon as its last trajectory ends, releasing its claim:
    # a request's groups never wait for its slowest one (the replay's budget and the learner see them at
    # once). In lockstep every group of the request ends at the same turn anyway.
    per_group = w.cfg.rollout.per_trajectory
    groups, rstats = await _arollout(w, items, stage_index, stage, w.cfg.rollout.temperature, seed=seed,
                                     on_group=hand_off if per_group else None, off_engine=w._off_engine)
    if not per_group:
        for j, group in enumerate(groups):
            await hand_off(j, group)
    with w._lock:
        w._stats["gen_s"] += rstats.generate_s
        w._stats["retrieve_s"] += rstats.retrieve_s


async def _arollout(w: "RolloutWorker", items, stage_index: int, stage: StageConfig, temperature: float,
                    search_enabled: bool = True, seed: int | None = None, on_group=None, off_engine=None):
    from sonar.actors.rewards import make_reward_fn
    from sonar.actors.rollout import rollout_groups

    return await rollout_groups(
        items, engine=w.engine, retriever=w.retriever, tokenizer=w.tokenizer, tags=w.tags,
        proto=w.cfg.protocol, temperature=temperature, top_p=w.cfg.rollout.top_p,  # greedy ignores top_p
        group_size=w.cfg.rollout.group_size if temperature > 0 else 1,
        k=w.cfg.retrieval.k, reward_fn=make_reward_fn(stage.reward, w.tokenizer, w.tags),
        actor_id=w.worker_id, stage=stage_index, search_enabled=search_enabled, seed=seed,
        per_trajectory=w.cfg.rollout.per_trajectory, tools=w.tools, on_group=on_group, off_engine=off_engine)
