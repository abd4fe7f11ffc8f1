"""Plug-ins: user code named in the config, resolved once at load, the same door as the built-ins.

Five kinds (``KINDS``), each a config field that takes either a built-in name or a plug-in:

=========  ====================================  =====================================================
kind       field                                 what the named object is
=========  ====================================  =====================================================
reward     ``stages.N.reward.name``              ``fn(sample: RewardInput[, config: RewardConfig])``
                                                 -> float | ``RewardBreakdown`` (``actors/rewards.py``)
retriever  ``retrieval.backend``                 ``make(config: RetrievalConfig, corpus: str | None,
                                                 index_root: str) -> Retriever`` (``retrieval/base.py``)
dataset    ``stages.N.format`` / ``eval.format``  ``load(path: str) -> iterable of dicts with question,
                                                 golds (and optionally qid, meta)`` or of ``QAItem``
tool       ``protocol.tools`` (a list)           ``make(config: Config) -> Tool`` (``actors/tools.py``)
algorithm  ``stages.N.algo.name``                ``fn(rewards, group_index, mask, *, std_normalize, kl,
                                                 kl_coef) -> advantages`` carrying its ``AlgoSpec``
                                                 (``cluster/wire/algos.py``, ``learner/algo/advantages.py``)
=========  ====================================  =====================================================

A plug-in is written ``module.path:attr`` or ``path/to/file.py:attr``:

* **Dotted path**: imported with ``importlib``. The module must be importable in every process that
  uses it: installed, or a module of the job's working dir (``ray job submit --working-dir .`` ships
  it and every Ray process of the job runs in it, with it first on ``sys.path``).
* **File path**: one self-contained Python file (it may import installed packages and ``sonar``).
  Its source is read once at load and kept in ``Config.plugins`` (path -> source); every process
  builds the module from that text, so the plug-in travels with the config to every Ray actor on any
  node, and the run's saved config records the code it ran. A relative path is relative to the
  directory ``sonar`` starts in.

Built-ins register in the module that implements them (``Registry.register``; ``actors/rewards.py``,
``retrieval/factory.py``, ``actors/datasets.py``, ``actors/tools.py``,
``learner/algo/advantages.py``), and ``Registry.get`` serves a
built-in name and a plug-in alike. The config layer, which imports nothing of those modules, knows
the built-in names from ``BUILTIN_NAMES`` (a test keeps each registry equal to its names) and checks
a plug-in at load with ``check``: the file or module exists, the attribute exists and is callable.

Pure module: standard library only.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import threading
import types
from pathlib import Path
from typing import Any, Callable, Mapping

KINDS = ("reward", "retriever", "dataset", "tool", "algorithm")

BUILTIN_NAMES: dict[str, tuple[str, ...]] = {
    "reward": ("answer_em", "answer_f1", "cover_em", "search_r1", "rag_r1", "r1_stage1", "r1_stage2"),
    "retriever": ("tantivy", "elasticsearch", "dense", "http"),
    "tool": ("search", "visit"),
    "algorithm": ("grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline", "group_norm", "ppo"),
}
"""The built-in entries of each registry, as the config validates them (``dataset``: the config's
``DATA_FORMATS``). Each registry's entries are pinned to these by tests/cluster/test_plugins.py."""
INDEXED_RETRIEVERS = ("tantivy", "elasticsearch", "dense")
"""The built-in retrievers that search an index Sonar builds from ``retrieval.corpus`` (``sonar index``, the
dense reranker's passage vectors); every other backend (http, a plug-in) holds its own."""


FIELDS: dict[str, tuple[str, str]] = {
    "reward": ("stages.N.reward.name", "fn(sample: RewardInput[, config: RewardConfig]) -> float | RewardBreakdown"),
    "retriever": ("retrieval.backend", "make(config: RetrievalConfig, corpus: str | None, index_root: str) -> Retriever"),
    "dataset": ("stages.N.format, eval.format", "load(path: str) -> iterable of QAItem | {question, golds[, qid, meta]}"),
    "tool": ("protocol.tools", "make(config: Config) -> Tool"),
    "algorithm": ("stages.N.algo.name", "@algorithm(AlgoSpec(...)) fn(rewards, group_index, mask, *, std_normalize, "
                  "kl, kl_coef) -> Tensor [B, T-1]"),
}
"""Each kind's config field and the signature a plug-in of it has (``sonar config list`` prints them)."""


class PluginError(ValueError):
    """A plug-in that cannot be resolved; the message names the config field, the value and what is missing."""


def is_plugin(value: Any) -> bool:
    """Whether a config value names a plug-in (``target:attr``) rather than a built-in name."""
    return isinstance(value, str) and ":" in value


def _split(value: str, field: str) -> tuple[str, str, bool]:
    """(target, attribute, is a file path) of ``target:attr``."""
    target, _, attr = value.rpartition(":")
    if not target or not attr or not attr.isidentifier():
        raise PluginError(f"{field}={value!r}: a plug-in is 'module.path:attr' or 'path/to/file.py:attr' "
                          f"(got target {target!r}, attribute {attr!r})")
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    return target, attr, is_file


def read_source(value: str, field: str) -> tuple[str, str] | None:
    """For a file plug-in, (its path as written, its source text); None for a dotted path. Raises
    ``PluginError`` naming the field and the resolved path when the file is missing or unreadable."""
    target, _, is_file = _split(value, field)
    if not is_file:
        return None
    path = Path(target).expanduser()
    try:
        return target, path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PluginError(f"{field}={value!r}: file {str(path.resolve())!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PluginError(f"{field}={value!r}: cannot read {str(path.resolve())!r}: {e}") from None


_MODULES: dict[str, types.ModuleType] = {}
_LOCK = threading.Lock()
_SOURCES: dict[str, str] = {}
"""File plug-ins' sources this process was handed (``remember``): a Ray actor receives the config once
and remembers its ``plugins``, so code deep in a role (a reward function, the evaluation path) resolves
a file plug-in without the config being threaded to it."""


def remember(sources: Mapping[str, str]) -> None:
    """Keep ``Config.plugins`` for this process (the config's sources win over a file read later)."""
    with _LOCK:
        _SOURCES.update(sources)


def _file_module(target: str, source: str, field: str) -> types.ModuleType:
    """The module built from a file plug-in's source, once per process and source (keyed by its hash,
    so an edited file in a later config is a new module, never a stale one)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = f"sonar_plugin_{Path(target).stem.replace('-', '_')}_{digest}"
    with _LOCK:
        mod = _MODULES.get(name)
        if mod is not None:
            return mod
        mod = types.ModuleType(name)
        mod.__file__ = str(Path(target).expanduser().resolve())
        sys.modules[name] = mod  # dataclasses and pickle look a module up by name
        try:
            exec(compile(source, mod.__file__, "exec"), mod.__dict__)
        except Exception as e:
            sys.modules.pop(name, None)
            raise PluginError(f"{field}: plug-in file {target!r} failed to import: {type(e).__name__}: {e}") from e
        _MODULES[name] = mod
        return mod


def load(value: str, field: str, sources: Mapping[str, str] | None = None) -> Any:
    """The object a plug-in value names. File plug-ins come from ``sources`` (``Config.plugins``) when it
    holds their path, else from the file. Raises ``PluginError`` naming the field, the value and what
    was missing (module, file, attribute)."""
    target, attr, is_file = _split(value, field)
    if is_file:
        source = (sources or {}).get(target)
        if source is None:
            with _LOCK:
                source = _SOURCES.get(target)
        if source is None:
            read = read_source(value, field)
            assert read is not None
            source = read[1]
        mod = _file_module(target, source, field)
    else:
        try:
            mod = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise PluginError(f"{field}={value!r}: module {e.name!r} not found (it must be importable in every "
                              f"process: installed, or in the job's working dir)") from None
        except Exception as e:
            raise PluginError(f"{field}={value!r}: importing {target!r} failed: {type(e).__name__}: {e}") from e
    try:
        obj = getattr(mod, attr)
    except AttributeError:
        public = sorted(n for n in vars(mod) if not n.startswith("_"))[:20]
        raise PluginError(f"{field}={value!r}: {target!r} has no attribute {attr!r} (it has: {public})") from None
    if not callable(obj):
        raise PluginError(f"{field}={value!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def positional_arity(fn: Callable) -> tuple[int, int]:
    """(required, maximum) positional parameters of ``fn`` (maximum is large for ``*args``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0, 99
    pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    req = sum(1 for p in pos if p.default is p.empty)
    return req, 99 if any(p.kind is p.VAR_POSITIONAL for p in params) else len(pos)


def check(kind: str, value: str, field: str, sources: Mapping[str, str] | None = None,
          arity: tuple[int, int] | None = None) -> None:
    """Resolve a plug-in at config load: it exists and is callable, and, with ``arity`` = (least, most),
    it can be called with that many positional arguments. Raises ``PluginError``."""
    if kind not in KINDS:
        raise PluginError(f"{field}: unknown plug-in kind {kind!r}; one of {list(KINDS)}")
    obj = load(value, field, sources)
    if arity is not None:
        req, most = positional_arity(obj)
        lo, hi = arity
        if req > hi or most < lo:
            want = f"{lo}" if lo == hi else f"{lo} or {hi}"
            raise PluginError(f"{field}={value!r}: a {kind} plug-in is called with {want} positional argument(s); "
                              f"{getattr(obj, '__name__', obj)!r} takes {req} required and {most} at most")


class Registry:
    """One kind's entries: built-ins registered by name in the module that implements them, plug-ins by
    ``target:attr``. ``get`` serves both, so a built-in and a user's plug-in take the same path."""

    def __init__(self, kind: str):
        if kind not in KINDS:
            raise ValueError(f"unknown plug-in kind {kind!r}; one of {list(KINDS)}")
        self.kind = kind
        self._entries: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator: ``@REWARDS.register("answer_em")``. A name is registered once."""
        if is_plugin(name):
            raise ValueError(f"a built-in {self.kind} name cannot contain ':' ({name!r})")

        def deco(obj: Any) -> Any:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj
        return deco

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def get(self, value: str, field: str, sources: Mapping[str, str] | None = None) -> Any:
        """The entry ``value`` names: a built-in, or the plug-in it spells (``load``)."""
        if is_plugin(value):
            return load(value, field, sources)
        try:
            return self._entries[value]
        except KeyError:
            raise PluginError(f"{field}={value!r} is not a built-in {self.kind} ({list(self._entries)}) nor a "
                              "plug-in 'module.path:attr' / 'path/to/file.py:attr'") from None
