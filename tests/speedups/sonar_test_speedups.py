"""The test suite's start-up speed-ups, for every Python process it starts (the test process, the Ray nodes'
workers, the subprocesses of CLI and job tests): ``sitecustomize.py`` beside this file installs them, and
``tests/conftest.py`` puts this folder first on ``PYTHONPATH``. They are the suite's, not Sonar's: a library
does not patch other packages, and a user's process pays the second or two they save (issue 55). On a
2-core machine every actor's process pays about 2.3 s of CPU for transformers' import without them, and the
suite starts a few hundred.

- transformers' model classes load without scikit-learn and SciPy (``_transformers_without``);
- ``importlib.metadata.packages_distributions`` and transformers' import structure are kept on disk per
  installed environment (``_CachedPackagesDistributions``, ``_CachedImportStructure``).

``tests/test_import_cost.py`` checks that what the suite's processes see is what a user's would: the
packages still import, the cached answers equal the computed ones. ``SONAR_METADATA_CACHE=0`` switches the
caches off; ``SONAR_TRANSFORMERS_SKLEARN=1``/``SONAR_TRANSFORMERS_SCIPY=1`` leave transformers that package.
Nothing of Sonar is imported here.
"""
import sys as _sys

TRANSFORMERS_WITHOUT = (  # (transformers' probe, the package, the variable that keeps it for transformers)
    ("is_sklearn_available", "sklearn", "SONAR_TRANSFORMERS_SKLEARN"),
    ("is_scipy_available", "scipy", "SONAR_TRANSFORMERS_SCIPY"),
)
"""Optional packages transformers imports for features Sonar never runs (``_transformers_without``)."""


def _transformers_without(import_utils) -> None:
    """Every Sonar process (driver, actors, CLI) imports transformers' model classes, and that import
    pulls in optional packages for features Sonar never runs when they are installed (they are: MLflow
    needs both):

    - scikit-learn (and SciPy), by ``transformers.generation.candidate_generator``, for the ``roc_curve``
      of assisted generation's confidence-threshold tuning: about 1 s of CPU per process on a 2-core CPU
      machine (measured: a rollout actor's imports and policy load 6.5-7.5 s -> 5.7-6.2 s of CPU);
    - ``scipy.optimize``, by the object-detection losses of ``transformers.loss`` (which ``modeling_utils``
      loads for every model), for the Hungarian matching of DETR-like vision models: 0.3 s of CPU per
      process idle, 0.55-0.65 s in a learner and a rollout actor starting side by side.

    So, once ``transformers.utils.import_utils`` has loaded and before anything asks: transformers' cached
    ``is_<package>_available()`` is computed while the package is hidden (``sys.modules[name] = None``,
    which ``importlib.util.find_spec`` reports as absent), so it stays False for the process and those
    modules skip the import (the vision classes that need SciPy are marked as missing it, as without
    it); the entry is removed at once, so ``import sklearn``/``import scipy`` work as usual afterwards
    (MLflow's flavours, a user's reward). Nothing changes for a package already imported or already
    answered for, and ``SONAR_TRANSFORMERS_SKLEARN=1``/``SONAR_TRANSFORMERS_SCIPY=1`` leave transformers
    that package (a plug-in that uses transformers' own sklearn- or SciPy-backed code)."""
    import os

    for probe_name, package, keep in TRANSFORMERS_WITHOUT:
        probe = getattr(import_utils, probe_name, None)
        if (os.environ.get(keep) == "1" or package in _sys.modules or probe is None
                or getattr(probe, "cache_info", None) is None or probe.cache_info().currsize):
            continue
        _sys.modules[package] = None
        try:
            probe()
        finally:
            if _sys.modules.get(package, 0) is None:
                del _sys.modules[package]


class _CachedPackagesDistributions:
    """``importlib.metadata.packages_distributions()`` (and the ``importlib_metadata`` backport's), kept
    on disk per installed environment. transformers calls it when it is imported (every role of every
    run), MLflow when it logs a model; it reads the ``RECORD`` of every installed distribution that has no
    ``top_level.txt`` (116 of 235 here), about 0.9 s of CPU per call on a 2-core CPU machine, and gives the
    same answer in every process of an unchanged environment.

    The answer is a pure function of the distributions on ``sys.path``, so the key is: the Python
    version, which implementation, and each ``sys.path`` directory's ``*.dist-info``/``*.egg-info``/
    ``*.egg`` entries with their modification times (a ``pip install``, upgrade or uninstall adds, renames
    or rewrites one; listing them costs about 1 ms). A folder on ``sys.path`` with no such entry (a
    script's own folder, the current directory, a job's unpacked working dir) finds no distribution and
    is left out of the key (it used to make a key of its own: every Ray job, whose working dir is on its
    processes' ``sys.path``, computed the map again). The ten or so maps one run of the test suite still
    computes differ in what they hold (Ray's workers add ``ray/thirdparty_files``, a wheel's own venv, the
    backport against the standard library). A hit returns a fresh copy of the stored mapping; a
    miss computes it and stores it atomically (concurrent starts may compute it twice, never read half a
    file); an unreadable or unwritable cache computes it as before. Where: ``$SONAR_CACHE_DIR`` or
    ``~/.cache/sonar``; ``SONAR_METADATA_CACHE=0`` switches it off."""

    SUFFIXES = (".dist-info", ".egg-info", ".egg")

    def __init__(self, compute, implementation: str):
        self.compute, self.implementation = compute, implementation
        self.__wrapped__ = compute
        self.__doc__ = compute.__doc__

    def key(self) -> str:
        import hashlib
        import os

        h = hashlib.sha256(f"{_sys.version}\0{self.implementation}".encode())
        for entry in _sys.path:
            d = entry or os.getcwd()
            try:
                names = sorted((e.name, e.stat().st_mtime_ns) for e in os.scandir(d) if e.name.endswith(self.SUFFIXES))
            except OSError:  # not a directory (a zip, a path hook's name) or gone: nothing of it is read
                continue
            if names:  # a folder with no distribution's metadata adds nothing to the answer: not to the key either
                h.update(f"\0{os.path.abspath(d)}\0{names!r}".encode())
        return h.hexdigest()[:32]

    def __call__(self):
        import json
        import os

        path = None  # stays None when the key itself fails: nothing is stored
        try:
            path = os.path.join(_cache_dir(), f"packages_distributions-{self.key()}.json")
            with open(path) as f:
                stored = json.load(f)
            return {k: list(v) for k, v in stored.items()}
        except (OSError, ValueError):
            pass
        result = self.compute()
        _store(path, lambda f: f.write(json.dumps(result).encode()))
        return result


def _cache_dir() -> str:
    import os

    return os.environ.get("SONAR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sonar")


class _CachedImportStructure:
    """transformers' ``create_import_structure_from_path`` (``transformers.utils.import_utils``), kept on
    disk per installed transformers. ``import transformers`` (every role of every run) calls it on the
    ``models`` folder, which opens and scans the ~3,200 source files of its ~1,050 model folders for their
    ``__all__`` and ``@requires`` lines: about 0.75 s of CPU per process on a 2-core CPU machine, and the
    same answer in every process while those files do not change.

    The answer is a pure function of the folder's files (their names and contents) and of transformers'
    own code, so the key is: the Python version, transformers' version, the folder, and every file and
    folder under it with its size and modification time (a ``pip install``/upgrade rewrites them, an edit
    changes the time; listing them costs about 15 ms). Only calls from outside (``define_import_structure``)
    are looked up; the function's calls to itself for subfolders run as before. A hit returns the stored
    structure (``marshal``: dicts, sets, frozensets and strings only); a miss computes and stores it
    atomically. An unreadable or unwritable cache computes it as before. ``SONAR_METADATA_CACHE=0``
    switches it off with the module map's cache."""

    def __init__(self, compute, version: str):
        self.compute, self.version = compute, version
        self.__wrapped__ = compute
        self.__doc__ = compute.__doc__
        self._inside = 0
        self._memo: dict = {}

    def cache_clear(self) -> None:  # transformers' clear_import_cache() clears the lru_cache it replaces
        self._memo.clear()
        getattr(self.compute, "cache_clear", lambda: None)()

    def key(self, folder: str) -> str:
        import hashlib
        import os

        h = hashlib.sha256(f"{_sys.version}\0{self.version}\0{folder}".encode())
        stack = [folder]
        while stack:
            d = stack.pop()
            with os.scandir(d) as entries:
                for e in sorted(entries, key=lambda e: e.name):
                    if e.name == "__pycache__":
                        continue
                    st = e.stat(follow_symlinks=True)
                    h.update(f"\0{e.path}\0{st.st_size}\0{st.st_mtime_ns}".encode())
                    if e.is_dir():
                        stack.append(e.path)
        return h.hexdigest()[:32]

    def __call__(self, module_path):
        if self._inside:  # the function's own call for a subfolder
            return self.compute(module_path)
        import os

        memo_key = os.fspath(module_path)
        if memo_key in self._memo:  # the same object on the same argument, as the lru_cache gave
            return self._memo[memo_key]
        self._inside += 1
        try:
            result = self._load_or_compute(module_path)
        finally:
            self._inside -= 1
        self._memo[memo_key] = result
        return result

    def _load_or_compute(self, module_path):
        import marshal
        import os

        path = None  # stays None when the key itself fails: nothing is stored
        try:
            folder = os.path.realpath(os.fspath(module_path))
            if os.path.isfile(folder):
                folder = os.path.dirname(folder)
            path = os.path.join(_cache_dir(), f"import_structure-{self.key(folder)}.marshal")
            with open(path, "rb") as f:
                return marshal.load(f)
        except (OSError, ValueError, EOFError, TypeError):
            pass
        result = self.compute(module_path)
        _store(path, lambda f: marshal.dump(result, f))
        return result


def _store(path, dump) -> None:
    """Write a cache file atomically (``dump(f)`` into a temporary file, then renamed): concurrent
    processes may write it twice, never read half of it. Nothing is stored without a ``path`` or when
    the folder cannot be written or the value cannot be serialised (the caller recomputes next time)."""
    import os

    if path is None:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            dump(f)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):  # TypeError: not JSON; ValueError: not marshallable
        try:
            os.remove(tmp)
        except OSError:
            pass


def _cache_import_structure(module):
    fn = getattr(module, "create_import_structure_from_path", None)
    if fn is not None and not isinstance(fn, _CachedImportStructure):
        version = ""
        try:
            import importlib.metadata

            version = importlib.metadata.version("transformers")
        except Exception:  # noqa: BLE001 - no version: the files' times and sizes still key the cache
            pass
        module.create_import_structure_from_path = _CachedImportStructure(fn, version)


class _PatchOnLoad:
    """Runs ``after(module)`` once the module ``trigger`` has loaded: wraps
    ``importlib_metadata.packages_distributions`` when the backport loads (MLflow imports it; most Sonar
    processes never do, so it is not imported here for nothing), and when ``transformers.utils.import_utils``
    loads: its answers for the packages of ``TRANSFORMERS_WITHOUT``, and ``create_import_structure_from_path``."""

    def __init__(self, trigger: str, after):
        self.trigger, self.after = trigger, after

    def find_spec(self, name, path=None, target=None):
        if name != self.trigger:
            return None
        if self in _sys.meta_path:
            _sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ExecThen(spec.loader, self.after)
        return spec


class _ExecThen:
    """A module's own loader, followed by ``after(module)`` once the module has run."""

    def __init__(self, loader, after):
        self.loader, self.after = loader, after

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        try:
            self.loader.exec_module(module)
        finally:
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader
        self.after(module)


def _cache_packages_distributions(module):
    fn = getattr(module, "packages_distributions", None)
    if fn is not None and not isinstance(fn, _CachedPackagesDistributions):
        module.packages_distributions = _CachedPackagesDistributions(fn, f"{module.__name__} {getattr(module, '__version__', '')}")


def install():
    """Install the hooks in this process (idempotent); a module already loaded is patched at once."""
    import os

    after_load = {"transformers.utils.import_utils": [_transformers_without]}
    if os.environ.get("SONAR_METADATA_CACHE") != "0":
        import importlib.metadata

        _cache_packages_distributions(importlib.metadata)
        after_load["importlib_metadata"] = [_cache_packages_distributions]
        after_load["transformers.utils.import_utils"].append(_cache_import_structure)
    hooked = {f.trigger for f in _sys.meta_path if isinstance(f, _PatchOnLoad)}
    for trigger, afters in after_load.items():
        after = _each(afters)
        if trigger in _sys.modules:
            after(_sys.modules[trigger])
        elif trigger not in hooked:
            _sys.meta_path.insert(0, _PatchOnLoad(trigger, after))


def _each(functions):
    """One ``after(module)`` that runs each of ``functions`` on the module, in order."""
    def after(module):
        for f in functions:
            f(module)
    return after
