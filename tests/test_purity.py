"""The pure core (parsing, rewards, advantages, losses, masks, codec, config) imports neither Ray nor
DeepSpeed, so it runs and is tested without a cluster."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # one fresh Python process for all (tests/backend_guard.py)

PURE = ["sonar.cluster.wire.protocol", "sonar.cluster.wire.config", "sonar.cluster.replay.queue",
        "sonar.cluster.transport.weights", "sonar.cluster.transport.transport", "sonar.cluster.wire.metrics", "sonar.cluster.wire.logs", "sonar.actors.parsing",
        "sonar.actors.multiquery", "sonar.actors.rewards",
        "sonar.actors.prompts", "sonar.actors.world", "sonar.learner.algo.advantages", "sonar.learner.algo.losses",
        "sonar.learner.algo.staleness", "sonar.learner.batching", "sonar.learner.deepspeed_config",
        "sonar.retrieval.base", "sonar.retrieval.resilient"]


BANNED = ("ray", "deepspeed", "vllm", "mlflow", "elasticsearch")

PRELOAD = ("numpy", "torch", "omegaconf", "yaml", "msgpack")
"""Allowed libraries the pure modules use, imported once in the parent below (torch alone takes seconds)."""

# One fresh interpreter imports the allowed libraries, checks that none of them brought in a banned one,
# then forks a child per module: each child starts from exactly that state, imports its module, and
# reports which banned modules are now loaded. The same check as one fresh interpreter per module,
# without paying torch's import 17 times.
FORK_IMPORTS = f"""
import importlib, json, os, sys, traceback
BANNED = {BANNED!r}
for name in {PRELOAD!r}:
    importlib.import_module(name)
preloaded = [m for m in BANNED if m in sys.modules]
results = {{"__preload__": {{"bad": preloaded, "error": None}}}}
for module in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(module)
            out = {{"bad": [m for m in BANNED if m in sys.modules], "error": None}}
        except BaseException:
            out = {{"bad": [], "error": traceback.format_exc()}}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    results[module] = json.loads(data) if data else {{"bad": [], "error": f"child exited with status {{status}}"}}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def imports():
    import json

    out = subprocess.run([sys.executable, "-c", FORK_IMPORTS, *PURE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["__preload__"]["bad"] == [], f"the preloaded {PRELOAD} import {results['__preload__']['bad']}"
    return results


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_ray_or_deepspeed(module, imports):
    got = imports[module]
    assert got["error"] is None, got["error"]
    assert got["bad"] == [], f"{module} imports {','.join(got['bad'])}"
