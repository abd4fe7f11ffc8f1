"""The worker extension (actors/vllm_extension.py) runs inside vLLM's worker on GPUs too, where vLLM 0.32
picks Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``) while this CPU runs V1's CPU runner
(issue 21, item 9). What the extension calls on ``self.model_runner`` must exist with the same
parameters in all three runners: read from the installed vLLM's source (no import: V2 needs Triton)."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

RUNNERS = {"v1 gpu (the CPU runner's base)": "v1/worker/gpu_model_runner.py",
           "v2 gpu": "v1/worker/gpu/model_runner.py"}


def _vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _methods(path: Path, cls: str = "GPUModelRunner") -> dict[str, list[str]]:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {f.name: [a.arg for a in f.args.args + f.args.kwonlyargs]
                    for f in node.body if isinstance(f, ast.FunctionDef)}
    raise AssertionError(f"{path}: no class {cls}")


def _runner_calls() -> dict[str, set[str]]:
    """The methods the extension calls on ``self.model_runner`` and the keywords it passes."""
    src = (Path(__file__).resolve().parents[2] / "actors" / "vllm_extension.py").read_text()
    calls: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(src)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "model_runner"):
            calls.setdefault(node.func.attr, set()).update(k.arg for k in node.keywords if k.arg)
    return calls


def test_the_extension_calls_the_runner():
    calls = _runner_calls()
    # The streamed push (issue 21 item 3) loads through vLLM's layerwise-reload session on the runner's
    # model (initialize once, model.load_weights per bucket, finalize), as vLLM's NCCL engine does.
    assert "get_model" in calls
    src = (_vllm_dir() / "model_executor/model_loader/reload/__init__.py").read_text()
    assert all(f in src for f in ("initialize_layerwise_reload", "finalize_layerwise_reload"))


@pytest.mark.parametrize("name", list(RUNNERS))
def test_every_runner_has_what_the_extension_calls(name):
    base = _vllm_dir()
    methods = _methods(base / RUNNERS[name])
    cpu = base / "v1/worker/cpu_model_runner.py"
    assert "class CPUModelRunner(GPUModelRunner)" in cpu.read_text()  # the CPU runner inherits V1's methods
    for method, keywords in _runner_calls().items():
        assert method in methods, f"{name}: GPUModelRunner has no {method}"
        assert keywords <= set(methods[method]), f"{name}: {method} lacks {keywords - set(methods[method])}"
