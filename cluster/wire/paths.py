"""Where a run's files go and where config presets are found (pure: standard library only).

``run.root`` (and a relative ``run.run_dir`` / ``retrieval.index_dir``) is made absolute when the config
is loaded, so every role and every cache (corpus, tantivy index, passage vectors, checkpoints, the MLflow
store in the run directory) sees one persistent location:

1. ``run.root`` set in the config: an absolute path is kept; a relative one is taken relative to the
   *base* below.
2. ``run.root`` unset (the default ``""``): ``$SONAR_RUN_ROOT`` (relative: against the base), else
   ``<base>/runs``, except inside a Ray job's uploaded working directory, where it is ``~/sonar-runs``.
3. The base is the working directory, unless that is Ray's temporary package folder
   (``<session>/runtime_resources/working_dir_files/_ray_pkg_<hash>``: what ``ray job submit
   --working-dir`` runs in; a new folder after every local edit). There the base is ``$SONAR_RUN_ROOT``,
   else ``~/sonar-runs``, and a log line says so: a run must survive the next upload (``run.resume=latest``,
   the index and vectors reused).

Presets: ``--config tiny`` names ``configs/tiny.yaml`` shipped inside the package; a path is used as a
path; a relative path that does not exist here but names a shipped preset (``configs/smoke.yaml`` from
wherever ``ray start`` ran) is the shipped one.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import sys
from pathlib import Path
from typing import Mapping

log = logging.getLogger("sonar")

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The presets, shipped inside the package (``sonar/configs/*.yaml``; pyproject's package-data)."""
RUN_ROOT_ENV = "SONAR_RUN_ROOT"
"""Environment variable naming the run root when the config leaves ``run.root`` unset."""
RAY_JOB_FALLBACK = "~/sonar-runs"
"""The run root inside a Ray job's package folder when ``$SONAR_RUN_ROOT`` is unset."""


class PresetError(ValueError):
    """``--config`` names neither an existing file nor a shipped preset."""


def in_ray_package_dir(cwd: str | os.PathLike) -> bool:
    """True when ``cwd`` is (inside) a working directory Ray unpacked for a job or task
    (``.../runtime_resources/working_dir_files/...``): temporary, replaced after each upload."""
    parts = Path(cwd).parts
    for i, part in enumerate(parts[:-1]):
        if part == "runtime_resources" and parts[i + 1] in ("working_dir_files", "py_modules_files"):
            return True
    return False


def _abs(p: str, base: Path) -> Path:
    q = Path(os.path.expanduser(p))
    return q if q.is_absolute() else base / q


def path_base(environ: Mapping[str, str], cwd: str | os.PathLike) -> tuple[Path, str | None]:
    """(base for relative run paths, a note when the working directory was not usable)."""
    cwd = Path(cwd)
    if not in_ray_package_dir(cwd):
        return cwd, None
    env = environ.get(RUN_ROOT_ENV)
    base = _abs(env, Path(os.path.expanduser("~"))) if env else Path(os.path.expanduser(RAY_JOB_FALLBACK))
    return base, (f"the working directory {cwd} is Ray's temporary package folder (ray job submit "
                  f"--working-dir); run files go under {base} instead "
                  f"({'$' + RUN_ROOT_ENV if env else '$' + RUN_ROOT_ENV + ' unset: ' + RAY_JOB_FALLBACK})")


def resolve_run_root(root: str, environ: Mapping[str, str], cwd: str | os.PathLike) -> tuple[Path, str | None]:
    """The absolute run root for the config value ``root`` (see the module docstring), and a note to log
    when Ray's package folder was avoided."""
    if root and Path(os.path.expanduser(root)).is_absolute():
        return Path(os.path.expanduser(root)), None
    base, note = path_base(environ, cwd)
    if root:
        return base / root, note
    env = environ.get(RUN_ROOT_ENV)
    if env:
        return _abs(env, Path(cwd) if note is None else Path(os.path.expanduser("~"))), note
    return (base if note is not None else base / "runs"), note


def resolve_relative(path: str | None, environ: Mapping[str, str], cwd: str | os.PathLike) -> str | None:
    """``path`` made absolute against the same base as ``run.root`` (None and "" unchanged)."""
    if not path:
        return path
    return str(_abs(path, path_base(environ, cwd)[0]))


CODE_FOLDERS = ("actors", "learner", "retrieval", "cluster")
"""The production code whose fingerprint ``code_origin`` reports (tests and benchmarks are not shipped in
every copy)."""


def code_fingerprint(root: Path) -> str:
    """A hash of the package's production ``.py`` files under ``root`` (``CODE_FOLDERS`` and the top-level
    modules), names and contents: equal for two copies of the same code wherever they lie."""
    files = sorted([*root.glob("*.py"), *(f for d in CODE_FOLDERS for f in (root / d).rglob("*.py"))])
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def code_origin() -> str:
    """Which Sonar this process runs: ``sonar <__version__> (<fingerprint>) from <package directory>``
    (``code_fingerprint``; the directory with links resolved, so a job's staged checkout names the
    checkout). Every role reports it at start-up (``roles.log_code_origins`` compares all but the
    directory, which differs between a job's working dir and its actors' copy), so a job whose actors run
    other code than the driver is seen at once."""
    pkg = sys.modules["sonar"]  # imported: this module is sonar.cluster.wire.paths
    root = Path(pkg.__file__).resolve().parent
    return f"sonar {getattr(pkg, '__version__', '?')} ({code_fingerprint(root)}) from {root}"


CONFIG_HELP = ("YAML file or preset name (`sonar config list`), repeatable, merged in order; "
               "default: the tiny preset")
"""Help of every verb's ``--config`` (``sonar train|eval|config|index|chaos``): one text, so they agree."""


def presets() -> dict[str, Path]:
    """Shipped presets by name (``tiny`` -> ``.../configs/tiny.yaml``), sorted."""
    return {p.stem: p for p in sorted(CONFIG_DIR.glob("*.yaml"))}


def preset_summary(path: Path) -> str:
    """The first sentence of a preset's opening comment, without ``# name.yaml —`` (what ``sonar config
    list`` prints): the comment lines are joined until the sentence ends (". " or the paragraph's end, a
    blank comment line, or a command line indented under ``#   ``), so no description stops mid-sentence."""
    words: list[str] = []
    for i, line in enumerate(path.read_text().splitlines()):
        s = line.strip()
        if not s:
            if words:
                break
            continue
        if not s.startswith("#") or line.startswith("#   ") or not s.lstrip("#").strip():
            break
        text = s.lstrip("#").strip()
        if not words:
            for sep in (" — ", " -- ", " - "):
                head, found, tail = text.partition(sep)
                if found and head.strip() == path.name:
                    text = tail.strip()
                    break
        words.append(text)
        joined = " ".join(words)
        end = re.search(r"(?<!\.)[.!?](\s|$)", joined)  # an ellipsis ("...") is not an end
        if end:
            return joined[: end.start() + 1]
    return " ".join(words)


def find_config(name: str | os.PathLike, cwd: str | os.PathLike | None = None) -> Path:
    """The config file ``--config name`` means: an existing file; else a shipped preset by name
    (``smoke``, ``smoke.yaml``) or by its repository path (``configs/smoke.yaml``, for commands run
    where that relative path does not exist). Raises ``PresetError`` naming the presets otherwise."""
    p = Path(os.path.expanduser(str(name)))
    base = Path(cwd) if cwd is not None else Path.cwd()
    if (p if p.is_absolute() else base / p).is_file():
        return (p if p.is_absolute() else base / p).resolve()
    known = presets()
    if not p.is_absolute():
        parts = p.parts
        if len(parts) == 1 or (len(parts) == 2 and parts[0] == "configs"):
            stem = p.name[:-5] if p.name.endswith(".yaml") else p.name
            if stem in known and (len(parts) == 1 or p.suffix == ".yaml"):
                return known[stem]
    raise PresetError(f"config {str(name)!r}: no such file, and not a preset name "
                      f"(presets: {', '.join(known) or 'none shipped'}; `sonar config list`)")
