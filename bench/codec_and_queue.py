"""codec-and-queue: what do the rollout wire format and the replay queue cost per group?

Question (issue 6): msgpack encode and decode MB/s for realistic trajectories (512 to 32k tokens), and
replay-queue put/get throughput, one by one against batched.

Codec. ``make_trajectory`` builds a realistic search-agent trajectory with ``cluster.protocol``: a
PROMPT (1/8 of the tokens), then turns of MODEL (reasoning + query, with float32 logprobs and a policy
version) and RETRIEVAL (documents) segments, a final MODEL answer; 40 % of the non-prompt tokens are
MODEL tokens. Each turn has a ``SearchCall`` (1-3 queries, 3 doc ids per query, latency); the
trajectory carries reward parts, question, golds and prediction. A GRPO group of 8 trajectories is one
message (``encode_group``), so MB/s is measured per group: message bytes / seconds. Every size is
round-tripped once and compared field by field before timing.

Queue. The real ``ray.remote(ReplayQueue)`` actor (capacity large enough never to block, stale policy
``downweight`` so nothing is dropped) receives encoded groups as a rollout worker would. Modes, timed
from the first call to the last reply, reported as items/s and ms/item (item = one group):

- ``replay/put_one``: ``ray.get(q.put.remote(...))`` per group: one round trip per group.
- ``replay/put_inflight``: ``ReplayQueue`` has no batched put, so "batched" is ``batch`` concurrent
  ``put`` calls in flight, then one ``ray.get`` on the list (what a batched put would save at most is
  the per-call overhead that remains here).
- ``replay/get_one``: ``q.get(n_groups=1)`` per group.
- ``replay/get_batched``: ``q.get(n_groups=batch)``: the batched get that ``ReplayQueue`` has.
- ``replay/get_inflight``: ``batch`` concurrent ``get(n_groups=1)`` calls.
- ``replay/noop_call``: a round trip to the same actor that does nothing (``set_learner_version``):
  the floor of any one-by-one call.
- ``rayqueue/put_one``, ``rayqueue/get_one``, ``rayqueue/put_batch``, ``rayqueue/get_batch``:
  ``ray.util.queue.Queue`` with ``put``/``get`` against ``put_nowait_batch``/``get_nowait_batch``, the
  comparison behind the replay's batched get (about 4 ms per put/get pair against 0.3 ms per item
  batched on a 2-core machine).

Payload sizes matter because Ray inlines arguments under 100 KB and moves larger ones through the
object store: the queue is measured with groups of 8 x 512 tokens (29 KB) and 8 x 8k tokens (376 KB).
Modes are interleaved inside every repeat so background load hits them alike; ratios are paired per
repeat. After each repeat the queue's accounting must balance and every get must return what was asked.

Simplifications: one producer and one consumer (the driver); with many workers the actor's event loop,
not the driver, becomes the limit, which this does not measure.
"""
from __future__ import annotations

import time
from pathlib import Path

from sonar.bench.common import base_parser, init_ray_local, setup_env, summarise, write_result

setup_env()

NAME = "codec-and-queue"
GROUP = 8
VOCAB = 151_936
FULL = {"codec_tokens": [512, 2048, 8192, 32768], "codec_repeats": 5, "codec_min_s": 0.25,
        "queue_tokens": [512, 8192], "queue_items": 128, "batch": 16, "repeats": 5}
QUICK = {"codec_tokens": [512, 2048], "codec_repeats": 1, "codec_min_s": 0.05,
         "queue_tokens": [512], "queue_items": 32, "batch": 16, "repeats": 1}
# (mode, timed): puts and gets alternate so the queue is empty after each repeat; the second
# put_inflight only refills the queue for get_inflight.
REPLAY_SCHEDULE = (("noop_call", True), ("put_one", True), ("get_one", True), ("put_inflight", True),
                   ("get_batched", True), ("put_inflight", False), ("get_inflight", True))
RAYQUEUE_MODES = ("put_one", "get_one", "put_batch", "get_batch")
WORDS = ("who", "founded", "the", "company", "that", "acquired", "city", "river", "born", "capital", "of",
         "when", "did", "director", "film", "album", "released", "population", "country", "largest")


def _label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def _words(rng, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def make_trajectory(n_tokens: int, rng, idx: int = 0, version: int = 3):
    """A search-agent trajectory of exactly ``n_tokens`` tokens (see the module docstring)."""
    import numpy as np

    from sonar.cluster.wire.protocol import FinishReason, SearchCall, Segment, SegmentKind, Trajectory

    prompt = max(32, n_tokens // 8)
    rest = n_tokens - prompt
    turns = max(1, min(8, rest // 400))
    model_total = int(rest * 0.4)
    model_sizes = np.full(turns + 1, model_total // (turns + 1))
    model_sizes[-1] += model_total - model_sizes.sum()
    retr_total = rest - model_total
    retr_sizes = np.full(turns, retr_total // turns)
    retr_sizes[-1] += retr_total - retr_sizes.sum()

    def ids(n):
        return rng.integers(0, VOCAB, int(n), dtype=np.int32)

    def model(n):
        return Segment(SegmentKind.MODEL, ids(n), (-rng.exponential(0.7, int(n))).astype(np.float32), version)

    segs = [Segment(SegmentKind.PROMPT, ids(prompt))]
    searches = []
    for t in range(turns):
        segs += [model(model_sizes[t]), Segment(SegmentKind.RETRIEVAL, ids(retr_sizes[t]))]
        queries = [_words(rng, 6) for _ in range(int(rng.integers(1, 4)))]
        searches.append(SearchCall(turn=t, queries=queries,
                                   doc_ids=[[f"wiki-{int(d)}" for d in rng.integers(0, 21_000_000, 3)]
                                            for _ in queries],
                                   latency_ms=float(rng.uniform(2, 40))))
    segs.append(model(model_sizes[-1]))
    traj = Trajectory(traj_id=f"t{idx}", group_id=f"g{idx // GROUP}", prompt_id=f"p{idx // GROUP}",
                      actor_id=idx % 4, segments=segs, reward=1.0,
                      reward_parts={"em": 1.0, "f1": 0.83, "format": 1.0, "retrieval": 0.5}, searches=searches,
                      finish_reason=FinishReason.ANSWERED, question=_words(rng, 18) + "?",
                      golds=[_words(rng, 2), _words(rng, 3)], prediction=_words(rng, 2), stage=1)
    assert traj.num_tokens() == n_tokens
    return traj


def make_group(n_tokens: int, seed: int = 0) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [make_trajectory(n_tokens, rng, i) for i in range(GROUP)]


def _same(a, b) -> bool:
    import numpy as np

    if len(a.segments) != len(b.segments) or a.searches != b.searches or a.reward_parts != b.reward_parts:
        return False
    for x, y in zip(a.segments, b.segments):
        if x.kind != y.kind or x.version != y.version or not np.array_equal(x.token_ids, y.token_ids):
            return False
        if x.logprobs is not None and not np.array_equal(x.logprobs, y.logprobs):
            return False
    return (a.traj_id, a.question, a.golds, a.prediction, a.finish_reason) == \
        (b.traj_id, b.question, b.golds, b.prediction, b.finish_reason)


def _rate(fn, min_s: float) -> tuple[float, int]:
    """Seconds per call of ``fn``, over as many calls as fill ``min_s`` (at least 1)."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    n = max(1, int(min_s / max(one, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n, n


def bench_codec(cfg: dict, metrics: dict, rows: list) -> None:
    from sonar.cluster.wire.protocol import decode_group, encode_group

    for n_tok in cfg["codec_tokens"]:
        group = make_group(n_tok, seed=n_tok)
        msg = encode_group(group)
        back = decode_group(msg)
        if not all(_same(a, b) for a, b in zip(group, back)) or len(back) != len(group):
            raise RuntimeError(f"codec round trip changed a {n_tok}-token group")
        mb = len(msg) / 1e6
        enc, dec = [], []
        for _ in range(cfg["codec_repeats"]):
            enc.append(_rate(lambda: encode_group(group), cfg["codec_min_s"])[0])
            dec.append(_rate(lambda: decode_group(msg), cfg["codec_min_s"])[0])
        key = f"codec/tokens={_label(n_tok)}"
        metrics[f"{key}/encode_mb_per_s"] = summarise(mb / t for t in enc)
        metrics[f"{key}/decode_mb_per_s"] = summarise(mb / t for t in dec)
        metrics[f"{key}/encode_ms_per_group"] = summarise(t * 1e3 for t in enc)
        metrics[f"{key}/decode_ms_per_group"] = summarise(t * 1e3 for t in dec)
        metrics[f"{key}/message_mb"] = summarise([mb])
        rows.append({"tokens": n_tok, "group": GROUP, "message_bytes": len(msg),
                     "bytes_per_token": len(msg) / (GROUP * n_tok),
                     "encode_mb_s": metrics[f"{key}/encode_mb_per_s"]["median"],
                     "decode_mb_s": metrics[f"{key}/decode_mb_per_s"]["median"],
                     "encode_ms": metrics[f"{key}/encode_ms_per_group"]["median"],
                     "decode_ms": metrics[f"{key}/decode_ms_per_group"]["median"]})
        r = rows[-1]
        print(f"[codec] {GROUP} x {n_tok} tokens: {len(msg) / 1e6:.2f} MB ({r['bytes_per_token']:.2f} B/token), "
              f"encode {r['encode_mb_s']:.0f} MB/s ({r['encode_ms']:.2f} ms), "
              f"decode {r['decode_mb_s']:.0f} MB/s ({r['decode_ms']:.2f} ms)", flush=True)


def _replay_mode(ray, q, mode: str, payload: bytes, items: int, batch: int) -> float:
    """Run ``items`` groups through ``mode``; returns seconds. Checks every reply."""
    # The replay accepts a group only against an outstanding claim (one claim admits one put), as a
    # rollout worker holds one: claim the prompts first, outside the timed span.
    claimed = ray.get(q.claim.remote(0, items)) if mode.startswith("put") else []
    if mode.startswith("put") and len(claimed) != items:
        raise RuntimeError(f"replay claim returned {len(claimed)} prompts, expected {items}")

    def put(i):
        return q.put.remote(payload, 0, GROUP, claimed[i], 0)

    def check_get(reply, n):
        if len(reply["groups"]) != n or reply["timed_out"] or any(len(g) != len(payload) for g in reply["groups"]):
            raise RuntimeError(f"replay get returned {len(reply['groups'])} groups, expected {n} "
                               f"(timed_out={reply['timed_out']})")

    t0 = time.perf_counter()
    if mode == "noop_call":
        for _ in range(items):
            ray.get(q.set_learner_version.remote(0))
    elif mode == "put_one":
        for i in range(items):
            if not ray.get(put(i)):
                raise RuntimeError("replay put refused (queue closed)")
    elif mode == "put_inflight":
        for start in range(0, items, batch):
            if not all(ray.get([put(i) for i in range(start, min(items, start + batch))])):
                raise RuntimeError("replay put refused (queue closed)")
    elif mode == "get_one":
        for _ in range(items):
            check_get(ray.get(q.get.remote(1, 0, 10.0)), 1)
    elif mode == "get_batched":
        for start in range(0, items, batch):
            n = min(batch, items - start)
            check_get(ray.get(q.get.remote(n, 0, 10.0)), n)
    elif mode == "get_inflight":
        for start in range(0, items, batch):
            for r in ray.get([q.get.remote(1, 0, 10.0) for _ in range(min(batch, items - start))]):
                check_get(r, 1)
    else:
        raise ValueError(f"unknown replay mode {mode!r}")
    return time.perf_counter() - t0


def _rayqueue_mode(rq, mode: str, payload: bytes, items: int, batch: int) -> float:
    t0 = time.perf_counter()
    if mode == "put_one":
        for _ in range(items):
            rq.put(payload)
    elif mode == "get_one":
        for _ in range(items):
            if len(rq.get(timeout=10)) != len(payload):
                raise RuntimeError("ray.util.queue returned a wrong item")
    elif mode == "put_batch":
        for start in range(0, items, batch):
            rq.put_nowait_batch([payload] * min(batch, items - start))
    elif mode == "get_batch":
        for start in range(0, items, batch):
            got = rq.get_nowait_batch(min(batch, items - start))
            if len(got) != min(batch, items - start):
                raise RuntimeError("ray.util.queue batch get returned too few items")
    else:
        raise ValueError(f"unknown ray.util.queue mode {mode!r}")
    return time.perf_counter() - t0


def bench_queue(cfg: dict, metrics: dict, rows: list) -> None:
    import ray
    from ray.util.queue import Queue

    from sonar.cluster.wire.protocol import encode_group
    from sonar.cluster.replay.queue import ReplayQueue

    items, batch = cfg["queue_items"], cfg["batch"]
    q = ray.remote(ReplayQueue).options(num_cpus=0).remote(10 * items, 1_000_000, "downweight", 1000, 0)
    rq = Queue(maxsize=0, actor_options={"num_cpus": 0})
    try:
        ray.get(q.stats.remote())
        rq.size()
        for n_tok in cfg["queue_tokens"]:
            payload = encode_group(make_group(n_tok, seed=1))
            times: dict = {}
            # warm-up: one pass of every mode (worker start, object-store paths), not timed
            for m, _ in REPLAY_SCHEDULE:
                _replay_mode(ray, q, m, payload, batch, batch)
            for m in RAYQUEUE_MODES:
                _rayqueue_mode(rq, m, payload, batch, batch)
            for _ in range(cfg["repeats"]):
                for m, timed in REPLAY_SCHEDULE:
                    dt = _replay_mode(ray, q, m, payload, items, batch)
                    if timed:
                        times.setdefault(f"replay/{m}", []).append(dt)
                for m in RAYQUEUE_MODES:
                    times.setdefault(f"rayqueue/{m}", []).append(_rayqueue_mode(rq, m, payload, items, batch))
                st = ray.get(q.stats.remote())
                if not st["balanced"] or st["depth_groups"] != 0 or rq.size() != 0:
                    raise RuntimeError(f"queue accounting: {st}, ray.util.queue size {rq.size()}")
            key = f"queue/tokens={_label(n_tok)}"
            for m, ts in times.items():
                metrics[f"{key}/{m}/items_per_s"] = summarise(items / t for t in ts)
                metrics[f"{key}/{m}/ms_per_item"] = summarise(t / items * 1e3 for t in ts)

            def ratio(a, b):  # paired per repeat: ms/item of a over ms/item of b
                return summarise(x / y for x, y in zip(times[a], times[b]))

            metrics[f"ratio/{key}/replay_put_one_over_inflight"] = ratio("replay/put_one", "replay/put_inflight")
            metrics[f"ratio/{key}/replay_get_one_over_batched"] = ratio("replay/get_one", "replay/get_batched")
            metrics[f"ratio/{key}/replay_get_one_over_inflight"] = ratio("replay/get_one", "replay/get_inflight")
            metrics[f"ratio/{key}/replay_put_one_over_noop_call"] = ratio("replay/put_one", "replay/noop_call")
            metrics[f"ratio/{key}/rayqueue_put_one_over_batch"] = ratio("rayqueue/put_one", "rayqueue/put_batch")
            metrics[f"ratio/{key}/rayqueue_get_one_over_batch"] = ratio("rayqueue/get_one", "rayqueue/get_batch")
            row = {"tokens": n_tok, "payload_bytes": len(payload), "items": items, "batch": batch}
            row.update({m: metrics[f"{key}/{m}/ms_per_item"]["median"] for m in times})
            rows.append(row)
            print(f"[queue] groups of {GROUP} x {n_tok} tokens ({len(payload) / 1e3:.0f} KB), ms/item: "
                  + ", ".join(f"{m} {row[m]:.3f}" for m in times), flush=True)
    finally:
        ray.kill(q)
        rq.shutdown()


def plot(metrics: dict, extra: dict, png: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    codec, queue = extra["codec"], extra["queue"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [1, 1.6]})
    xs = [r["tokens"] for r in codec]
    for what, style in (("encode", "o-"), ("decode", "s--")):
        ms = [metrics[f"codec/tokens={_label(t)}/{what}_mb_per_s"] for t in xs]
        a.errorbar(xs, [m["median"] for m in ms], fmt=style, capsize=3, label=what,
                   yerr=[[m["median"] - m["min"] for m in ms], [m["max"] - m["median"] for m in ms]])
    a.set(xscale="log", yscale="log", xlabel=f"tokens per trajectory (group of {GROUP})", ylabel="MB/s",
          title="msgpack codec (encode_group / decode_group)")
    a.set_xticks(xs, [_label(t) for t in xs])
    a.xaxis.set_minor_formatter(plt.NullFormatter())
    a.grid(True, which="both", alpha=0.3)
    a.legend()
    modes = [k for k in queue[0] if "/" in k] if queue else []
    width = 0.8 / max(1, len(queue))
    for i, r in enumerate(queue):
        pos = np.arange(len(modes)) + i * width
        b.bar(pos, [r[m] for m in modes], width, label=f"groups of {GROUP} x {_label(r['tokens'])} tokens "
                                                        f"({r['payload_bytes'] / 1e3:.0f} KB)")
    b.set_xticks(np.arange(len(modes)) + width * (len(queue) - 1) / 2, modes, rotation=35, ha="right", fontsize=8)
    b.set(yscale="log", ylabel="ms per group (lower is better)",
          title=f"queues: one by one vs batched/in flight (batch {extra['batch']})")
    b.grid(True, axis="y", which="both", alpha=0.3)
    if queue:
        b.legend(fontsize=8)
    else:
        b.text(0.5, 0.5, "queue not measured (--skip-queue)", ha="center", transform=b.transAxes)
    fig.suptitle("codec-and-queue (medians; codec bars = min..max)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# bench/README.md's rendering of a result (pure: no runs; `sonar bench readme`, tests/bench/test_readme_blocks.py)

QUEUE_ROWS = (("replay/noop_call", " (round-trip floor)"), ("replay/put_one", ""),
              ("replay/put_inflight", " ({batch} in flight)"), ("replay/get_one", ""),
              ("replay/get_batched", " (`get(n_groups={batch})`)"), ("replay/get_inflight", " ({batch} in flight)"),
              ("rayqueue/put_one", ""), ("rayqueue/put_batch", " (`put_nowait_batch`, {batch})"),
              ("rayqueue/get_one", ""), ("rayqueue/get_batch", " (`get_nowait_batch`, {batch})"))
"""The queue table's rows: mode, and what the mode is (``{batch}``: the groups per batched call)."""
QUEUE_RATIOS = (("replay put one / in flight", "replay_put_one_over_inflight"),
                ("replay get one / batched", "replay_get_one_over_batched"),
                ("replay put one / no-op call", "replay_put_one_over_noop_call"),
                ("ray.util.queue put one / batch", "rayqueue_put_one_over_batch"),
                ("ray.util.queue get one / batch", "rayqueue_get_one_over_batch"))


def _mid(m: dict, form: str = "{:.0f}") -> str:
    return f"{form.format(m['median'])} [{form.format(m['min'])}–{form.format(m['max'])}]"


def render_codec_table(doc: dict, json_name: str) -> str:
    """bench/README.md's codec table: per trajectory length, the group message, bytes per token, encode and
    decode MB/s (median [min–max]) and ms per group."""
    from sonar.bench.common import readme_block

    m = doc["metrics"]
    lines = ["| tokens / trajectory | group message | bytes/token | encode MB/s | decode MB/s | encode ms/group | "
             "decode ms/group |", "|---|---|---|---|---|---|---|"]
    for r in doc["extra"]["codec"]:
        key = f"codec/tokens={_label(r['tokens'])}"
        lines.append(f"| {r['tokens']} | {r['message_bytes'] / 1e3:.0f} KB | {r['bytes_per_token']:.2f} | "
                     f"{_mid(m[f'{key}/encode_mb_per_s'])} | {_mid(m[f'{key}/decode_mb_per_s'])} | "
                     f"{r['encode_ms']:.2f} | {r['decode_ms']:.2f} |")
    return readme_block("codec-and-queue codec", json_name, lines)


def render_queue_table(doc: dict, json_name: str) -> str:
    """bench/README.md's queue table: per mode and payload, ms per item (median [min–max]) and items/s; then
    the ratios of one-by-one to batched calls, paired per repeat (median over the repeats)."""
    from sonar.bench.common import readme_block

    m, rows, batch = doc["metrics"], doc["extra"]["queue"], doc["extra"]["batch"]
    size = {r["tokens"]: f"{r['payload_bytes'] / 1e3:.0f} KB" for r in rows}
    lines = ["| mode | " + " | ".join(f"{GROUP} × {r['tokens']} tokens ({size[r['tokens']]})" for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for mode, what in QUEUE_ROWS:
        keys = [f"queue/tokens={_label(r['tokens'])}/{mode}" for r in rows]
        cells = [f"{_mid(m[f'{k}/ms_per_item'], '{:.2f}')}, {m[f'{k}/items_per_s']['median']:.0f}/s" for k in keys]
        lines.append(f"| `{mode}`{what.format(batch=batch)} | " + " | ".join(cells) + " |")
    labels = [_label(r["tokens"]) for r in rows]
    ratios = "; ".join(label + " " + " and ".join(f"{m[f'ratio/queue/tokens={t}/{key}']['median']:.2f}" for t in labels)
                       for label, key in QUEUE_RATIOS)
    lines += ["", f"Ratios paired per repeat (ms/item of the first over the second, median over "
                  f"{doc['config']['repeats']} repeats; {' and '.join(size[r['tokens']] for r in rows)}): {ratios}."]
    return readme_block("codec-and-queue queues", json_name, lines)


def main(argv: list[str] | None = None) -> int:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=None, help="groups per batched call / calls in flight")
    p.add_argument("--skip-queue", action="store_true", help="codec only (no Ray)")
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.repeats:
        cfg["repeats"] = cfg["codec_repeats"] = args.repeats
    if args.batch:
        cfg["batch"] = args.batch
    cfg.update(quick=args.quick, group_size=GROUP, skip_queue=args.skip_queue,
               trajectory="prompt 1/8; turns of MODEL+RETRIEVAL (40% MODEL), final MODEL answer; "
                          "1-3 queries x 3 doc ids per turn")
    t0 = time.time()
    metrics: dict = {}
    extra: dict = {"codec": [], "queue": [], "batch": cfg["batch"]}
    bench_codec(cfg, metrics, extra["codec"])
    if not args.skip_queue:
        import ray

        owns = init_ray_local()
        try:
            bench_queue(cfg, metrics, extra["queue"])
        finally:
            if owns:
                ray.shutdown()
    extra["wall_s"] = round(time.time() - t0, 1)
    path = write_result(NAME, cfg, metrics, lambda png: plot(metrics, extra, png), args.out, extra=extra)
    print(f"[codec-and-queue] wrote {path} and {path.with_suffix('.png').name} in {extra['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
