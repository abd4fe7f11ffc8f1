"""``sonar bench NAME [--quick] [--out DIR] [...]``: run one benchmark script from ``bench/``.

Each benchmark answers one question and lives in its own module, ``bench/<name with _>.py`` (or
``bench/<name with _>_bench.py`` where the plain name would shadow a top-level package when the file
is run as a script, e.g. ``retrieval``). The module exposes ``main(argv) -> int``; everything after
NAME is passed to it unchanged, so each benchmark documents its own options (``sonar bench NAME -h``).

The dispatcher only resolves the name and sets the process environment (one thread per process, Ray
on loopback without token auth, headless matplotlib) before any benchmark imports torch or ray.
A known benchmark whose module is not written yet gets a clear error, not a traceback.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

from sonar.bench.common import setup_env

BENCHMARKS = {
    "async-vs-sync": "async vs synchronous training: learner and rollout utilisation, tokens/s",
    "rollout-scaling": "rollout throughput against the number of workers",
    "weight-sync": "learner -> workers weight broadcast: bucketed vs per-tensor vs ray.put, vs memcpy",
    "codec-and-queue": "msgpack trajectory codec MB/s and replay-queue put/get items/s, one by one vs batched",
    "retrieval": "retrieval latency and throughput per backend",
    "corpus-scale": "a 1 M-passage corpus: index and dense build (killed and resumed), start-up with and without rerank, serving; projected to 21 M",
    "end-to-end": "steps/s and tokens/s of the full training loop",
    "soak": "RSS of the driver, learner and workers over a long run: slope after warm-up (MB/min)",
    "multi-query": "RAG-R1's multi-query vs single-query search: per-question time, turns, retrievals at equal EM",
    "sensitivity": "async speedup as the learner share, the tail sigma and the batch size vary (one at a time)",
    "engines": "tokens/s of the rollout engines (transformers static and continuous, vLLM) at 1, 8 and 64 rows",
    "default-run": "what `sonar train` on the default preset gives, per training seed: the README's results table",
    "learner": "tokens/s and peak memory of a learner step: vocab 200 vs 151,936, chunked logits vs not, 1 vs 2 ranks",
    "schedule-sim": "async vs sync and colocated on a discrete-event simulator that drives the real ReplayCore",
    "lora": "LoRA against the whole model: one weight push's seconds and bytes, held-out EM of the default run",
    "readme": "runs nothing: every results table of README.md and bench/README.md rendered from the JSON it names",
}
USAGE = "usage: sonar bench NAME [--quick] [--out DIR] [options of NAME]   (sonar bench NAME -h for them)"


def module_candidates(name: str) -> list[str]:
    base = name.replace("-", "_")
    return [f"sonar.bench.{base}", f"sonar.bench.{base}_bench"]


def find_module(name: str) -> str | None:
    """The importable module of benchmark ``name``, or None if none of its candidate files exists."""
    for mod in module_candidates(name):
        if importlib.util.find_spec(mod) is not None:
            return mod
    return None


def available() -> list[str]:
    return [n for n in BENCHMARKS if find_module(n) is not None]


def _listing() -> str:
    lines = []
    for n, what in BENCHMARKS.items():
        state = "" if find_module(n) else "   (not written yet)"
        lines.append(f"  {n:<16} {what}{state}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--list", "list"):
        print(f"{USAGE}\n\nbenchmarks:\n{_listing()}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"sonar bench: unknown benchmark {name!r}. Available: {', '.join(available()) or 'none'}\n"
              f"{_listing()}", file=sys.stderr)
        return 2
    mod = find_module(name)
    if mod is None:
        files = " or ".join(m.removeprefix("sonar.").replace(".", "/") + ".py" for m in module_candidates(name))
        print(f"sonar bench: benchmark {name!r} is not written yet (no {files}). "
              f"Available: {', '.join(available()) or 'none'}", file=sys.stderr)
        return 2
    setup_env()
    rc = importlib.import_module(mod).main(rest)
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
