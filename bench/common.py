"""Shared plumbing for the benchmarks under ``bench/``: result files, hardware/version capture, summaries.

Every benchmark answers one question and writes ``<out>/<name>-<host>-<commit>.json`` plus a PNG next
to it. The JSON always holds the resolved config, the hardware (CPU count, memory, GPU if any), the
versions (python, torch, ray, ...), the commit, a UTC timestamp and ``metrics``: a mapping from a
slash-separated metric name to ``{"median", "min", "max", "n"}`` over repeats (``summarise``), or, for
a family of values keyed by a parameter, to one level of ``{key: summary}`` (``metrics["speedup"]["2"]``
in async-vs-sync, keyed by lag). Numbers are compared as ratios measured in the same run, never against
a fixed threshold, because absolute speed depends on the machine and on whatever else it is running.

Why a (nearly) flat metric mapping: the CI smoke test (``tests/bench``) validates every result file with
one rule ("each metric, or each entry of a one-level group, has median/min/max"), whatever the benchmark
measures.

Why the environment is set here: with 2 cores, torch's default of 2 threads per process makes small
ops 10-100x slower once a second process is busy, and Ray binds the machine's first network interface
unless told to use 127.0.0.1. ``setup_env()`` must run before torch or ray are imported.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable

REPO_ROOT = Path(__file__).resolve().parent.parent


def default_out(cwd: Path | None = None) -> Path:
    """Where results go without ``--out``: ``bench/results`` of the checkout ``sonar bench`` runs in (the
    committed results), else ``./sonar-bench-results`` in the current directory; never a folder inside
    an installed package."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    if (cwd / "bench" / "run.py").is_file() and (cwd / "pyproject.toml").is_file():
        return cwd / "bench" / "results"
    return cwd / "sonar-bench-results"

SUMMARY_KEYS = ("median", "min", "max", "n")
RESULT_KEYS = ("name", "config", "hardware", "versions", "commit", "timestamp", "metrics")

_ENV_DEFAULTS = {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg",
}


def setup_env() -> None:
    """One thread per process, Ray on loopback without token auth, headless matplotlib.
    Call before importing torch or ray (values already set by the caller win)."""
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def summarise(samples: Iterable[float]) -> dict:
    """{median, min, max, n} of a non-empty sequence of numbers."""
    xs = [float(x) for x in samples]
    if not xs:
        raise ValueError("summarise: no samples")
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None: used to cap sizes that would not fit."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info() -> dict:
    """CPU count (logical and usable by this process), CPU model, memory, GPU (None without CUDA), and the
    priorities the processes ran at (``niceness``)."""
    mem = _mem_total_bytes()
    info = {
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gb": round(mem / 2**30, 2) if mem else None,
        "platform": platform.platform(),
        "gpu": None,
        # Priority of this process and, for a local cluster it starts (roles.init_ray), of Ray's workers:
        # None there is Ray's default, nice 15, under which every actor yields to any other load (as in
        # every result written before sonar.cluster.wire.bootstrap.LOCAL_NODE_ENV; see bench/README.md, "Results on this machine").
        "niceness": {"driver": os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None,
                     "ray_workers_env": os.environ.get("RAY_worker_niceness")},
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = [{"name": torch.cuda.get_device_name(i),
                            "memory_gb": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 2)}
                           for i in range(torch.cuda.device_count())]
    except Exception:  # torch missing or a broken CUDA install: report no GPU rather than fail the bench
        pass
    return info


def versions() -> dict:
    """Versions of python and of the libraries a benchmark may exercise (None when not installed)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "ray", "numpy", "msgpack", "deepspeed", "transformers", "tantivy", "elasticsearch",
                "matplotlib", "sonar-rl"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def git_commit(short: bool = True) -> str:
    """The checked-out commit (short hash), or "unknown" outside a git checkout."""
    try:
        args = ["git", "rev-parse", "--short=10" if short else "--verify", "HEAD"]
        return subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


ALLOW_DIRTY_ENV = "SONAR_BENCH_ALLOW_DIRTY"
"""Set to 1 (``--allow-dirty`` sets it) to let a benchmark write results from a dirty tree; the JSON then
says ``allow_dirty: true`` and lists the dirty files."""
OUTPUT_PREFIXES = ("bench/results/",)
"""Paths that are benchmark outputs, not sources: an untracked result file does not make the tree dirty."""


def dirty_files(root: str | Path | None = None) -> list[str] | None:
    """Paths (relative to the repository) that differ from the checked-out commit: modified, staged,
    deleted AND untracked-but-not-ignored files, outputs under ``bench/results/`` excepted. None outside
    a git checkout. Untracked files count: a benchmark whose own file is not committed names a commit
    at which its code did not exist (issue 11)."""
    root = REPO_ROOT if root is None else root
    try:
        r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root,
                           capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    out = []
    for line in r.stdout.splitlines():
        if len(line) < 4:
            continue
        path = line[3:]
        if " -> " in path:  # a rename: the new name is the file that is there now
            path = path.split(" -> ", 1)[1]
        path = path.strip('"')
        if not path.startswith(OUTPUT_PREFIXES):
            out.append(path)
    return sorted(out)


def allow_dirty_requested() -> bool:
    return os.environ.get(ALLOW_DIRTY_ENV, "").strip().lower() in ("1", "true", "yes")


class DirtyTreeError(RuntimeError):
    """A benchmark was about to write results from a tree with uncommitted or untracked source changes."""


def check_provenance(allow_dirty: bool | None = None, root: str | Path | None = None) -> dict:
    """``{"commit", "dirty", "dirty_files", "allow_dirty"}`` for a result file; raises ``DirtyTreeError``
    when the tree is dirty and dirtiness was not allowed (``allow_dirty`` None: ``$SONAR_BENCH_ALLOW_DIRTY``)."""
    root = REPO_ROOT if root is None else root
    allow = allow_dirty_requested() if allow_dirty is None else bool(allow_dirty)
    files = dirty_files(root)
    if files and not allow:
        shown = ", ".join(files[:20]) + (f" ... ({len(files)} files)" if len(files) > 20 else "")
        raise DirtyTreeError(f"refusing to write benchmark results: the tree at {root} has uncommitted or untracked "
                             f"source changes ({shown}); commit them, or pass --allow-dirty (recorded in the JSON)")
    return {"dirty": None if files is None else bool(files), "dirty_files": files or [], "allow_dirty": allow}


_RUN_START: dict | None = None
"""``{"root", "commit"}`` as the benchmark's parser found them (``mark_run_start``): the commit whose code the
run started with, which is the one its result names. ``git_commit()`` at write time would name whatever
was checked out an hour later; Ray's workers and subprocesses started after a mid-run commit or checkout
ran that code, not the start's."""


def mark_run_start(root: str | Path | None = None) -> dict:
    """Record the commit a benchmark run starts from (the parser calls it once the tree is known clean)."""
    global _RUN_START
    root = REPO_ROOT if root is None else root
    _RUN_START = {"root": str(root), "commit": git_commit()}
    return _RUN_START


def run_commit(allow_dirty: bool) -> tuple[str, str | None]:
    """(the commit the result names, the commit HEAD moved to during the run or None). Raises
    ``DirtyTreeError`` when HEAD moved since ``mark_run_start`` and dirtiness was not allowed: part of the
    run then ran another commit's code."""
    now = git_commit()
    start = _RUN_START if _RUN_START is not None and _RUN_START["root"] == str(REPO_ROOT) else None
    if start is None or start["commit"] == now:
        return now, None
    if not allow_dirty:
        raise DirtyTreeError(f"refusing to write benchmark results: HEAD of {REPO_ROOT} moved from {start['commit']} "
                             f"to {now} during the run, so processes started after the move ran {now}'s code; "
                             "rerun from one commit, or pass --allow-dirty (both commits recorded in the JSON)")
    return start["commit"], now


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s)


def result_path(name: str, out_dir: str | Path, variant: str | None = None, commit: str | None = None) -> Path:
    """``<name>[-<variant>]-<host>-<commit>.json``: a variant (``rollout-scaling --engine vllm``) has a file of
    its own, so that measuring it does not replace the default's result of the same commit. ``commit``:
    the run's (``run_commit``); None: the one checked out now."""
    stem = f"{name}-{variant}" if variant else name
    return Path(out_dir) / f"{_safe(stem)}-{_safe(socket.gethostname())}-{_safe(commit or git_commit())}.json"


def _check_summary(label: str, m) -> None:
    if not isinstance(m, dict) or any(s not in m for s in SUMMARY_KEYS):
        raise ValueError(f"metric {label!r} is not a summary with {SUMMARY_KEYS}: {m!r}")
    if not (m["min"] <= m["median"] <= m["max"]):
        raise ValueError(f"metric {label!r}: min <= median <= max does not hold: {m!r}")


def validate_result(doc: dict) -> None:
    """Raise ValueError unless ``doc`` has every required key and every metric is a summary.

    A metric value is either a summary ``{median, min, max, n}`` or one level of grouping: a non-empty
    dict of string key -> summary (e.g. ``metrics["speedup"] = {"1": {...}, "2": {...}}``, keyed by lag).
    Deeper nesting is rejected. Errors name the metric as ``metrics.<key>`` or ``metrics.<key>.<sub>``.
    """
    missing = [k for k in RESULT_KEYS if k not in doc]
    if missing:
        raise ValueError(f"result misses keys {missing}")
    if not isinstance(doc["metrics"], dict) or not doc["metrics"]:
        raise ValueError("result has no metrics")
    for k, m in doc["metrics"].items():
        label = f"metrics.{k}"
        if not isinstance(m, dict) or any(s in m for s in SUMMARY_KEYS):
            _check_summary(label, m)  # meant as a summary (or not a dict at all)
            continue
        if not m:
            raise ValueError(f"metric {label!r} is an empty group: expected a summary with {SUMMARY_KEYS} "
                             f"or a non-empty mapping of name -> summary")
        for sub, sm in m.items():
            if not isinstance(sub, str) or not sub:
                raise ValueError(f"metric {label!r}: group keys must be non-empty strings, got {sub!r}")
            _check_summary(f"{label}.{sub}", sm)


def write_result(name: str, config: dict, metrics: dict, plot_fn: Callable[[Path], None] | None,
                 out_dir: str | Path | None = None, extra: dict | None = None, allow_dirty: bool | None = None,
                 variant: str | None = None) -> Path:
    """Write ``<out_dir>/<name>[-<variant>]-<host>-<commit>.json`` and, if ``plot_fn`` is given, the PNG beside
    it. ``variant``: a non-default setting of the benchmark that has a file of its own (recorded as the
    JSON's ``variant``); a rerun of the same benchmark, variant and commit on the same host replaces it.

    ``metrics``: metric name -> ``summarise(...)`` output, or -> a non-empty ``{key: summarise(...)}``
    group (one level only, string keys; see ``validate_result``). ``plot_fn(png_path)`` draws and saves the
    figure (matplotlib, Agg backend). ``extra`` holds anything that is not a summary (tables, notes,
    skipped configurations). Returns the JSON path.

    Provenance: refuses (``DirtyTreeError``, nothing written) when the source tree has uncommitted or
    untracked changes, or HEAD moved since the run started (``mark_run_start``), unless ``allow_dirty``
    (None: ``--allow-dirty`` / ``$SONAR_BENCH_ALLOW_DIRTY``); the JSON records ``allow_dirty`` and the
    ``dirty_files`` either way, names the commit the run started from, and adds ``commit_moved_to``
    when an allowed run saw HEAD move.
    """
    prov = check_provenance(allow_dirty)
    commit, moved_to = run_commit(prov["allow_dirty"])
    out = Path(out_dir) if out_dir is not None else default_out()
    out.mkdir(parents=True, exist_ok=True)
    path = result_path(name, out, variant, commit)
    png = path.with_suffix(".png")
    doc = {
        "name": name,
        "variant": variant,
        "config": config,
        "hardware": hardware_info(),
        "versions": versions(),
        "commit": commit,
        **({"commit_moved_to": moved_to} if moved_to else {}),
        "dirty": prov["dirty"],
        "dirty_files": prov["dirty_files"],
        "allow_dirty": prov["allow_dirty"],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "metrics": metrics,
        "extra": extra or {},
        "plot": png.name if plot_fn is not None else None,
    }
    validate_result(doc)
    if plot_fn is not None:
        os.environ.setdefault("MPLBACKEND", "Agg")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plot_fn(png)
        plt.close("all")
    path.write_text(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    return path


class _AllowDirty(argparse.Action):
    """``--allow-dirty``: sets ``$SONAR_BENCH_ALLOW_DIRTY`` so ``write_result`` (called without the parsed
    args by every benchmark) writes from a dirty tree and records that it was told to."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=False, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        os.environ[ALLOW_DIRTY_ENV] = "1"
        setattr(namespace, self.dest, True)


class _BenchParser(argparse.ArgumentParser):
    """Checks provenance right after parsing, so a dirty tree fails in a second, not after the run."""

    renders_only: str | None = None
    """An option that, when given, makes the command only render committed results (no run, no result
    written: ``default-run --readme``), so the provenance check does not apply."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        # intermixed: bare key=value overrides may sit before or after the options
        ns = self.parse_intermixed_args(args, namespace) if self._has_overrides else super().parse_args(args, namespace)
        if self._has_overrides:
            if ns.set_overrides:
                print("sonar bench: --set KEY=VALUE is deprecated; pass bare KEY=VALUE as `sonar train` does",
                      file=sys.stderr)
            ns.overrides = list(ns.set_overrides) + list(ns.overrides)
            del ns.set_overrides
        if self.renders_only is not None and getattr(ns, self.renders_only, None) is not None:
            return ns
        try:
            check_provenance()
        except DirtyTreeError as e:
            self.error(str(e))
        mark_run_start()
        return ns


def base_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --quick (CI smoke size, under a minute), --out, --repeats,
    --allow-dirty (write results from a tree with uncommitted/untracked changes; recorded in the JSON)."""
    p = _BenchParser(prog=f"sonar bench {name}", description=description)
    p._has_overrides = False
    p.add_argument("--allow-dirty", action=_AllowDirty,
                   help="write results even if the tree has uncommitted or untracked source changes "
                        "(the JSON then says allow_dirty: true and lists the files)")
    p.add_argument("--quick", action="store_true", help="smoke-test sizes (under a minute): checks it runs")
    p.add_argument("--out", default=str(default_out()),
                   help="output directory (default: bench/results in a Sonar checkout, else ./sonar-bench-results)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per point (default: the benchmark's own; 1 with --quick)")
    return p


def driver_bench_parser(name: str, description: str, config_hint: str) -> argparse.ArgumentParser:
    """``base_parser`` plus bare ``KEY=VALUE`` overrides, the syntax of every subcommand (``--set KEY=VALUE``
    is kept as a deprecated alias): for benchmarks that run Sonar's driver."""
    p = base_parser(name, description)
    p._has_overrides = True
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help=f"extra config overrides on top of {config_hint}")
    p.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="deprecated alias of a bare KEY=VALUE")
    return p


def bench_settings(args: argparse.Namespace, quick: dict, full: dict) -> dict:
    """A private copy of the benchmark's QUICK or FULL settings with ``--repeats`` applied; sets up
    INFO logging (the benchmarks report progress through the log)."""
    import copy

    from sonar.cluster.wire.logs import configure_logging

    configure_logging()  # the same log lines as the sonar command's (cluster/wire/logs.py)
    cfg = copy.deepcopy(quick if args.quick else full)
    if args.repeats:
        cfg["repeats"] = args.repeats
    return cfg


def init_ray_local(num_cpus: int | None = None, object_store_bytes: int | None = None) -> bool:
    """Start a local Ray on 127.0.0.1 unless one is running; returns True if this call started it
    (then the caller shuts it down). Never ``ray stop``: it kills every Ray process on the machine."""
    setup_env()
    import ray

    if ray.is_initialized():
        return False
    kw = {"object_store_memory": object_store_bytes} if object_store_bytes else {}
    # address="local": always a private cluster. Without it ray.init joins any cluster that someone
    # started on this machine with `ray start` (and then refuses num_cpus).
    from sonar.cluster.driver.roles import start_local_node

    start_local_node(lambda: ray.init(address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1),
                                      include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True,
                                      configure_logging=False, **kw))
    return True


def splice(text: str, begin: str, end: str, block: str, what: str) -> str:
    """``text`` with the one span from ``begin`` to ``end`` (markers included) replaced by ``block``: how a
    benchmark's ``--readme`` writes a results block rendered from its JSON into a document."""
    import re

    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    found = len(pattern.findall(text))
    if found != 1:
        raise ValueError(f"expected one {what} between {begin!r} and {end!r}, found {found}")
    return pattern.sub(lambda _: block, text)


def load_full_result(json_path: Path, name: str) -> dict:
    """The result at ``json_path`` if it is a full (not ``--quick``) result of benchmark ``name`` written from
    a clean tree: what a benchmark's ``--readme`` may render into a document; else a ValueError naming why."""
    import json

    doc = json.loads(Path(json_path).read_text())
    if doc.get("name") != name or doc.get("config", {}).get("quick") or doc.get("dirty"):
        raise ValueError(f"{json_path}: not a full {name} result from a clean tree (name {doc.get('name')!r}, "
                         f"quick {doc.get('config', {}).get('quick')}, dirty {doc.get('dirty')})")
    return doc


def block_result(text: str, begin: str) -> str | None:
    """The result file (``bench/results/<file>.json``) a document's block opened by ``begin`` names, or None."""
    import re

    m = re.search(re.escape(begin) + r"bench/results/(\S+\.json)", text)
    return m.group(1) if m else None


DOCS = ("README.md", "cluster/README.md", "actors/README.md", "retrieval/README.md", "tests/README.md")
"""The user documents: the top-level README.md and each room's own (bench/README.md is the benchmarks')."""
READMES = ("README.md", "cluster/README.md", "bench/README.md")
"""The documents whose results blocks ``sonar bench readme`` renders from the JSON each block names."""


def readme_block(kind: str, json_names: str | list[str], lines: list[str]) -> str:
    """A results block of a README, markers included: ``<!-- KIND table: bench/results/X.json (...) -->``,
    ``lines``, ``<!-- /KIND table -->``. ``kind`` is the benchmark's name, then a word naming the table when
    the benchmark has several; a block rendered from several results names each (comma-separated)."""
    names = [json_names] if isinstance(json_names, str) else list(json_names)
    paths = ", ".join(f"bench/results/{n}" for n in names)
    return "\n".join([f"<!-- {kind} table: {paths} (`sonar bench readme` writes this block; "
                      f"tests/bench/test_readme_blocks.py checks it) -->", *lines, f"<!-- /{kind} table -->"])
