"""``bench/gpu_check.py`` off the GPU: without CUDA it exits 0 with every check SKIP and writes its JSON;
``--cpu-smoke`` runs every check's code path on CPU at toy sizes (gloo broadcast group through Sonar's
``BroadcastGroup``, chunked vs unchunked learner step, a two-process shared-tensor hand-off) and passes,
importing no Sonar module but the torch-only files it loads by path and the wire's bucket plan they import
(the checkout made importable where Sonar is not installed), and neither Ray, DeepSpeed nor MLflow: the GPU
machine has torch only."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"
RUN = """
import runpy, sys, json
sys.argv = [{script!r}] + {args!r}
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as e:
    rc = e.code
bad = sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r} and m not in {allowed!r})
print("FORBIDDEN=" + json.dumps(bad))
sys.exit(rc)
"""


def run_check(tmp_path: Path, *args: str, env_extra: dict | None = None,
              forbidden=("sonar", "ray", "deepspeed", "mlflow")) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    from sonar.bench.gpu_check import TORCH_ONLY_PACKAGE  # the bucket plan and the packages above it

    code = RUN.format(script=str(SCRIPT), args=[*args, "--out", str(out)], forbidden=tuple(forbidden),
                      allowed=TORCH_ONLY_PACKAGE)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert "FORBIDDEN=[]" in r.stdout, r.stdout + r.stderr
    return r, json.loads(out.read_text())


@pytest.mark.slow
def test_without_cuda_every_check_skips(tmp_path):
    r, doc = run_check(tmp_path, env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert set(doc["checks"]) == {"nccl_broadcast", "learner_step", "cuda_ipc", "dp_sum_nccl",
                                  "push_memory_and_timing", "checksum_memory", "nograd_forward_memory",
                                  "colocated_handover", "zero2_rl_step", "zero2_lora_rl_step"}
    assert all(c["status"] == "SKIP" for c in doc["checks"].values())
    assert r.stdout.count("SKIP ") == 10


TORCH_ONLY = ["nccl_broadcast", "learner_step", "cuda_ipc", "dp_sum_nccl", "push_memory_and_timing",
              "checksum_memory", "nograd_forward_memory", "colocated_handover"]


@pytest.mark.slow
def test_cpu_smoke_runs_the_learner_step_check_through_sonar_and_deepspeed(tmp_path):
    """Checks 9 and 10 import Sonar's learner and DeepSpeed by design (carried as wheels to the GPU machine), and
    still not Ray. (Here DeepSpeed's monitor imports MLflow because it is installed; the GPU machine has none.)"""
    r, doc = run_check(tmp_path, "--cpu-smoke", "--only", "zero2_rl_step", "zero2_lora_rl_step",
                       env_extra={"CUDA_VISIBLE_DEVICES": ""}, forbidden=("ray",))
    c = doc["checks"]
    assert r.returncode == 0 and c["zero2_rl_step"]["status"] == c["zero2_lora_rl_step"]["status"] == "PASS", \
        r.stdout + r.stderr
    assert c["zero2_rl_step"]["tokens"] == c["zero2_lora_rl_step"]["tokens"] == 4 * 32
    # the LoRA learner's optimizer holds the adapters alone: rank 16 x (in + out) over the targeted linears
    assert c["zero2_lora_rl_step"]["lora_rank"] == 16
    assert 0 < c["zero2_lora_rl_step"]["trained_params"] < c["zero2_rl_step"]["trained_params"]


@pytest.mark.slow
def test_cpu_smoke_runs_every_torch_only_check(tmp_path):
    r, doc = run_check(tmp_path, "--cpu-smoke", "--only", *TORCH_ONLY, env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    c = doc["checks"]
    assert {k: v["status"] for k, v in c.items()} == dict.fromkeys(c, "PASS"), r.stdout
    assert c["nccl_broadcast"]["backend"] == "gloo" and c["nccl_broadcast"]["bytes"] > 0
    step = c["learner_step"]
    assert step["loss_chunked"] == pytest.approx(step["loss_unchunked"], rel=2e-2)
    assert step["chunked"]["chunk_tokens"] == 8 and step["chunked"]["tokens_per_s"] > 0
    assert c["cuda_ipc"]["gb_per_s"] > 0
    # the device-path checks: "cuda:gloo" refuses the CPU tensor NCCL would; the push holds two buckets
    assert c["dp_sum_nccl"]["backend"] == "cuda:gloo" and "cpu" in c["dp_sum_nccl"]["cpu_error"]
    push = c["push_memory_and_timing"]
    assert 0 < push["peak_extra_bytes"] <= push["two_buckets_bytes"]
    assert all(p["call_s"] >= 0.9 * p["synced_s"] for p in push["pushes"])
    assert c["checksum_memory"]["equal"] and c["nograd_forward_memory"]["status"] == "PASS"
    # colocated placement's hand-over into a second process (shm here, CUDA IPC on the GPU): every byte arrived
    hand = c["colocated_handover"]
    assert hand["backend"] == "shm" and hand["checksums_equal"] and hand["bytes"] > 0 and hand["gb_per_s"] > 0


NOT_INSTALLED = """
import importlib.util, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # as if Sonar were not installed
assert importlib.util.find_spec("sonar") is None
g = runpy.run_path({script!r}, run_name="not_main")
W = g["load_by_path"]("sonar_wire_weights", "cluster/transport/weights.py")
assert callable(W.plan_buckets) and callable(W.BroadcastGroup)
print(sorted(m for m in sys.modules if m == "sonar" or m.startswith(("sonar.", "sonar_wire"))))
"""


@pytest.mark.slow
def test_the_transport_loads_where_sonar_is_not_installed(tmp_path):
    """The device machine has the checkout and torch, not Sonar installed: the transport's weights.py, which
    imports the wire's bucket plan, loads through the checkout made importable as ``sonar``."""
    from sonar.bench.gpu_check import TORCH_ONLY_PACKAGE

    r = subprocess.run([sys.executable, "-c", NOT_INSTALLED.format(script=str(SCRIPT))], cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert set(json.loads(r.stdout.strip().replace("'", '"'))) == {"sonar_wire_weights", *TORCH_ONLY_PACKAGE}
