"""The suite's start-up speed-ups (``tests/speedups/``), and that Sonar itself patches nothing at import.

The speed-ups: transformers' model classes load without scikit-learn, which only assisted generation's
confidence-threshold tuning uses, and without SciPy, which only the object-detection losses use; both
still import afterwards, and ``SONAR_TRANSFORMERS_SKLEARN=1``/``SONAR_TRANSFORMERS_SCIPY=1`` leave
transformers as it is. The installed packages' module map (``packages_distributions``) and transformers'
import structure are kept on disk per environment and equal the computed answers. Fresh processes:
nothing may be loaded before."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test starts a fresh Python process (tests/backend_guard.py)

SPEEDUPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "speedups")
INSTALL = f"import sys\nsys.path.insert(0, {SPEEDUPS!r})\nimport sonar_test_speedups\nsonar_test_speedups.install()\n"
"""What the suite's ``sitecustomize`` runs, placed where each test wants it."""

CODE = (INSTALL +
        "from sonar.actors.worker import RolloutWorker\n"  # what a rollout actor's process runs first
        "from sonar.actors.model import build_policy\n"
        "from transformers import AutoModelForCausalLM, DynamicCache\n"
        "AutoModelForCausalLM.__name__\n"
        "from transformers.utils.import_utils import is_scipy_available, is_sklearn_available\n"
        "print('loaded', 'sklearn' in sys.modules, is_sklearn_available(), 'scipy' in sys.modules, is_scipy_available())\n"
        "from sklearn.metrics import roc_curve\n"
        "from scipy.optimize import linear_sum_assignment\n"
        "print('after', sys.modules['sklearn'] is not None, callable(roc_curve), sys.modules['scipy'] is not None,"
        " callable(linear_sum_assignment))\n")


def _without_speedups(pythonpath: str | None) -> str | None:
    kept = [p for p in (pythonpath or "").split(os.pathsep) if p and os.path.abspath(p) != SPEEDUPS]
    return os.pathsep.join(kept) or None


def _run(code: str, sitecustomize: bool = False, **env) -> list[str]:
    """Run ``code`` in a fresh process; without ``sitecustomize`` the speed-ups are only what ``code`` installs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    env["PYTHONPATH"] = _without_speedups(env.get("PYTHONPATH"))
    if sitecustomize:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SPEEDUPS, env["PYTHONPATH"]) if p)
    env = {k: v for k, v in env.items() if v is not None}
    for keep in ("SONAR_TRANSFORMERS_SKLEARN", "SONAR_TRANSFORMERS_SCIPY"):
        env.setdefault(keep, "0")  # the test's own choice, not the caller's environment
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")


def test_transformers_model_classes_load_without_sklearn_and_scipy_which_still_import_afterwards():
    loaded, after = _run(CODE)[:2]
    assert loaded == "loaded False False False False", loaded
    assert after == "after True True True True", after


def test_the_opt_outs_leave_transformers_its_sklearn_and_scipy():
    loaded, after = _run(CODE, SONAR_TRANSFORMERS_SKLEARN="1", SONAR_TRANSFORMERS_SCIPY="1")[:2]
    assert loaded == "loaded True True True True", loaded
    assert after == "after True True True True", after


def test_a_package_transformers_answered_for_before_the_speedups_loaded_is_left_alone():
    """transformers imported before Sonar: its import already asked for SciPy (its lazy module checks the
    model classes' backends) and the answer True stays (hiding SciPy then would break the module that
    imports it); scikit-learn, not asked for yet, is still hidden from it."""
    loaded, after = _run("import transformers\n" + CODE)[:2]
    assert loaded == "loaded False False True True", loaded
    assert after == "after True True True True", after


METADATA = ("import importlib.metadata as md, json, sys\n" +
            INSTALL +
            "got = md.packages_distributions()\n"
            "print(json.dumps({'wrapped': type(md.packages_distributions).__name__, 'got': got,"
            " 'fresh': md.packages_distributions.__wrapped__() if hasattr(md.packages_distributions, '__wrapped__')"
            " else got}))\n")


def test_the_module_map_is_kept_per_environment_and_recomputed_when_it_changes(tmp_path):
    cache = tmp_path / "cache"
    first = json.loads(_run(METADATA, SONAR_CACHE_DIR=str(cache))[0])
    assert first["wrapped"] == "_CachedPackagesDistributions"
    assert first["got"] == first["fresh"] and first["got"]["torch"] == ["torch"]
    (stored,) = cache.glob("packages_distributions-*.json")
    assert json.loads(stored.read_text()) == first["got"]

    # the next process reads the stored map (a marked copy proves it is read, not recomputed)...
    stored.write_text(json.dumps({**first["got"], "marked": ["marked"]}))
    second = json.loads(_run(METADATA, SONAR_CACHE_DIR=str(cache))[0])
    assert second["got"] == {**first["fresh"], "marked": ["marked"]}

    # ...also with a folder on sys.path that holds no distribution (a script's folder, a job's working dir):
    # nothing of it can change the answer, so it keeps the key
    plain = tmp_path / "plain"
    (plain / "somepkg").mkdir(parents=True)
    (plain / "somepkg" / "__init__.py").write_text("")
    pythonpath = os.pathsep.join(filter(None, [str(plain), os.environ.get("PYTHONPATH")]))
    other = json.loads(_run(METADATA, SONAR_CACHE_DIR=str(cache), PYTHONPATH=pythonpath)[0])
    assert other["got"] == {**first["fresh"], "marked": ["marked"]}
    assert len(list(cache.glob("packages_distributions-*.json"))) == 1

    # ...until the environment changes: a distribution installed on sys.path makes a new key
    site = tmp_path / "site"
    (site / "fake_dist-1.0.dist-info").mkdir(parents=True)
    (site / "fake_dist-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-dist\nVersion: 1.0\n")
    (site / "fake_dist-1.0.dist-info" / "top_level.txt").write_text("fakepkg\n")
    pythonpath = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    third = json.loads(_run(METADATA, SONAR_CACHE_DIR=str(cache), PYTHONPATH=pythonpath)[0])
    assert third["got"] == third["fresh"] and third["got"]["fakepkg"] == ["fake-dist"] and "marked" not in third["got"]
    assert len(list(cache.glob("packages_distributions-*.json"))) == 2

    # switched off: the function is the standard library's
    off = json.loads(_run(METADATA, SONAR_CACHE_DIR=str(cache), SONAR_METADATA_CACHE="0")[0])
    assert off["wrapped"] == "function" and "marked" not in off["got"]


def test_an_unwritable_cache_still_answers_and_the_backport_is_cached_too(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder should be: nothing can be stored under it
    code = ("import importlib.metadata as md, json, sys\n" + INSTALL +
            "assert 'importlib_metadata' not in sys.modules\n"  # not imported for nothing
            "import importlib_metadata as bp\n"
            "print(json.dumps([md.packages_distributions() == md.packages_distributions.__wrapped__(),"
            " type(bp.packages_distributions).__name__,"
            " bp.packages_distributions() == bp.packages_distributions.__wrapped__()]))\n")
    assert json.loads(_run(code, SONAR_CACHE_DIR=str(blocker / "sub"))[0]) == [True, "_CachedPackagesDistributions", True]
    cache = tmp_path / "ok"
    assert json.loads(_run(code, SONAR_CACHE_DIR=str(cache))[0]) == [True, "_CachedPackagesDistributions", True]
    assert len(list(cache.glob("packages_distributions-*.json"))) == 2  # the standard library's and the backport's


STRUCTURE = ("import json, sys\n" +
             INSTALL +
             "import transformers.utils.import_utils as iu\n"
             "f = iu.create_import_structure_from_path\n"
             "def enc(x):  # dicts, sets and frozensets of strings, nested: a canonical JSON form\n"
             "    if isinstance(x, dict):\n"
             "        return sorted(([enc(k), enc(v)] for k, v in x.items()), key=repr)\n"
             "    if isinstance(x, (set, frozenset)):\n"
             "        return ['set', sorted((enc(v) for v in x), key=repr)]\n"
             "    return x\n"
             "got = f(sys.argv[1])\n"
             "print(json.dumps({'wrapped': type(f).__name__, 'got': enc(got), 'again': f(sys.argv[1]) is got,\n"
             "                  'fresh': enc(f.__wrapped__.__wrapped__(sys.argv[1])) if type(f).__name__ == '_CachedImportStructure' else None}))\n")


def test_transformers_import_structure_is_kept_per_folder_and_recomputed_when_a_file_changes(tmp_path):
    """``import transformers`` scans its model folders' sources for their exports (about 0.75 s of CPU);
    the answer is stored per folder, keyed by every file's size and time, and read back by the next process."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "configuration_a.py").write_text('__all__ = ["SonarTestAConfig"]\n')
    (pkg / "modeling_a.py").write_text('import torch\n__all__ = ["SonarTestAModel", "SonarTestAPreTrainedModel"]\n')
    (pkg / "sub" / "modeling_b.py").write_text('__all__ = ["BModel"]\n')
    cache = tmp_path / "cache"

    def run(**env):
        return json.loads(_run(STRUCTURE.replace("sys.argv[1]", repr(str(pkg))), SONAR_CACHE_DIR=str(cache), **env)[0])

    first = run()
    assert first["wrapped"] == "_CachedImportStructure" and first["again"] is True
    assert first["got"] == first["fresh"]
    flat = json.dumps(first["got"])
    assert all(n in flat for n in ("SonarTestAConfig", "SonarTestAModel", "SonarTestAPreTrainedModel", "BModel", "torch"))
    mine = lambda: [p for p in cache.glob("import_structure-*.marshal") if b"SonarTestAConfig" in p.read_bytes()]
    (stored,) = mine()  # (transformers' own folders are stored beside it: importing it scans them)

    # the next process reads the stored structure (a marked copy proves it is read, not recomputed)...
    import marshal

    structure = marshal.loads(stored.read_bytes())
    structure[frozenset()]["marked"] = {"Marked"}
    stored.write_bytes(marshal.dumps(structure))
    second = run()
    assert "Marked" in json.dumps(second["got"]) and "Marked" not in json.dumps(second["fresh"])

    # ...until a file under the folder changes (size and time): a new key, the fresh answer
    (pkg / "sub" / "modeling_b.py").write_text('__all__ = ["BModel", "BForCausalLM"]\n')
    third = run()
    assert third["got"] == third["fresh"] and "BForCausalLM" in json.dumps(third["got"]) and "Marked" not in json.dumps(third["got"])
    assert len(mine()) == 2

    # switched off: transformers' own (lru-cached) function
    off = run(SONAR_METADATA_CACHE="0")
    assert off["wrapped"] == "_lru_cache_wrapper" and off["fresh"] is None and "Marked" not in json.dumps(off["got"])


def test_transformers_loads_its_model_classes_from_the_stored_structure(tmp_path):
    """Two fresh processes on one cache: the second reads every structure the first stored and loads the
    same model classes."""
    code = (INSTALL +
            "from transformers import AutoModelForCausalLM, Qwen2ForCausalLM, LlamaConfig\n"
            "import transformers.utils.import_utils as iu\n"
            "print(Qwen2ForCausalLM.__module__, LlamaConfig.__module__, type(iu.create_import_structure_from_path).__name__)\n")
    cache = tmp_path / "cache"
    first = _run(code, SONAR_CACHE_DIR=str(cache))[0]
    stored = sorted(p.name for p in cache.glob("import_structure-*.marshal"))
    assert stored  # transformers' models folder at least
    assert _run(code, SONAR_CACHE_DIR=str(cache))[0] == first == \
        "transformers.models.qwen2.modeling_qwen2 transformers.models.llama.configuration_llama _CachedImportStructure"
    assert sorted(p.name for p in cache.glob("import_structure-*.marshal")) == stored  # all read, none new


def test_importing_sonar_and_its_roles_patches_nothing():
    """Sonar is a library: importing it (and a role's module, outside a Ray worker) leaves other packages,
    the import machinery and the environment as they were (issue 55)."""
    code = ("import importlib.metadata as md, json, os, sys\n"
            "import ray\n"  # sets RAY_CLIENT_MODE at its import: Ray's doing, before the snapshot
            "meta, env, pd = list(sys.meta_path), dict(os.environ), md.packages_distributions\n"
            "import sonar, sonar.actors.worker, sonar.learner.worker, sonar.retrieval.server\n"
            "from transformers.utils.import_utils import is_sklearn_available\n"
            "print(json.dumps([sys.meta_path == meta, dict(os.environ) == env, md.packages_distributions is pd,"
            " is_sklearn_available(), sorted(k for k in dir(sonar) if not k.startswith('__'))]))\n")
    same_meta, same_env, same_pd, sklearn, names = json.loads(_run(code)[0])
    assert same_meta and same_env and same_pd and sklearn  # transformers sees scikit-learn, as installed
    assert names == ["actors", "cluster", "learner", "retrieval"]  # the subpackages imported, nothing else


def test_the_suites_processes_get_the_speedups_through_sitecustomize():
    code = ("import importlib.metadata as md\n"
            "print(type(md.packages_distributions).__name__)\n")
    assert _run(code, sitecustomize=True)[0] == "_CachedPackagesDistributions"
    assert _run(code)[0] == "function"
