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


def test_the_reload_miss_warning_the_extension_filters_is_vllms():
    """The extension drops vLLM's "<Layer>: Failed to load weights" for layers that load nothing by
    construction; if vLLM renamed its logger or reworded the message the filter would stop engaging, and
    the warnings (and the misses it reports) would go unseen by it: pinned to the installed source."""
    from sonar.actors.vllm_extension import RELOAD_LOGGER, RELOAD_MISS

    rel = RELOAD_LOGGER.removeprefix("vllm.").replace(".", "/") + ".py"
    src = (_vllm_dir() / rel).read_text()
    assert "logger = init_logger(__name__)" in src
    assert f'logger.warning("{RELOAD_MISS}", layer.__class__.__name__)' in src


def test_a_push_drops_only_the_misses_of_layers_that_load_nothing_by_construction():
    import logging

    import torch

    from sonar.actors.vllm_extension import RELOAD_LOGGER, RELOAD_MISS, _ReloadMisses, _unloadable_by_construction

    class RotaryEmbedding(torch.nn.Module):  # vLLM's: a cos/sin cache buffer, no parameter
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.zeros(4, 2))

    class ParallelLMHead(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

    class Model(torch.nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(5, 2)
            self.rotary = RotaryEmbedding()
            self.qkv = torch.nn.Linear(2, 6)
            self.lm_head = ParallelLMHead(self.embed_tokens.weight if tied else torch.nn.Parameter(torch.zeros(5, 2)))

    assert _unloadable_by_construction(Model(tied=True)) == {"RotaryEmbedding", "ParallelLMHead"}
    assert _unloadable_by_construction(Model(tied=False)) == {"RotaryEmbedding"}  # an untied head must load

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger(RELOAD_LOGGER)
    handler = Keep()
    log.addHandler(handler)
    try:
        misses = _ReloadMisses(_unloadable_by_construction(Model(tied=False)))
        with misses:
            for layer in ("RotaryEmbedding", "ParallelLMHead", "QKVParallelLinear"):
                log.warning(RELOAD_MISS, layer)
            log.warning("something else about %s", "RotaryEmbedding")
        log.warning(RELOAD_MISS, "RotaryEmbedding")  # the filter is gone once the reload has finalized
    finally:
        log.removeHandler(handler)
    assert misses.expected == 1 and misses.other == {"ParallelLMHead", "QKVParallelLinear"}
    assert seen == ["ParallelLMHead: Failed to load weights", "QKVParallelLinear: Failed to load weights",
                    "something else about RotaryEmbedding", "RotaryEmbedding: Failed to load weights"]
