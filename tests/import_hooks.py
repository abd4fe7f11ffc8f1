"""Run a function on a module right after its code has run, whether it is imported now or later.

Test-session patches of libraries (tests/backend_guard.py, tests/mlflow_store.py) go in through here so
that a run which never imports a library (``make test-fast`` never imports vLLM) never pays for importing
it. ``after_import(name, hook)`` calls ``hook(module)`` at once if ``name`` is imported already, else when
it is first imported (one meta-path finder wraps that module's loader).
"""
from __future__ import annotations

import importlib.abc
import sys
from typing import Callable

HOOKS: dict[str, list[Callable]] = {}
"""Module name -> what to run on it once its code has run."""


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, with the hooks run right after the module's code."""

    def __init__(self, inner, hooks):
        self._inner, self._hooks = inner, hooks

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        for hook in self._hooks:
            hook(module)

    def __getattr__(self, name):  # get_resource_reader, is_package, ... of the real loader
        return getattr(self._inner, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the hooked modules with the finders after it and wraps their loaders."""

    def find_spec(self, name, path, target=None):
        hooks = HOOKS.get(name)
        if not hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, list(hooks))
                return spec
        return None


def after_import(name: str, hook: Callable) -> None:
    """``hook(module)`` once module ``name`` has run (now if it is imported already). Hooks should be
    idempotent: a module imported afresh (removed from ``sys.modules``) gets them again."""
    HOOKS.setdefault(name, []).append(hook)
    if name in sys.modules:
        hook(sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
