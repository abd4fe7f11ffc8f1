"""``bench/gpu_check.py`` off the GPU: without CUDA it exits 0 with every check SKIP and writes its JSON;
``--cpu-smoke`` runs every check's code path on CPU at toy sizes (gloo broadcast group through Sonar's
``BroadcastGroup``, chunked vs unchunked learner step, a two-process shared-tensor hand-off) and passes,
importing no Sonar package module (it loads the two torch-only files by path) and neither Ray, DeepSpeed
nor MLflow: the GPU machine has torch only."""
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
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("sonar", "ray", "deepspeed", "mlflow"))
print("FORBIDDEN=" + json.dumps(bad))
sys.exit(rc)
"""


def run_check(tmp_path: Path, *args: str, env_extra: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    code = RUN.format(script=str(SCRIPT), args=[*args, "--out", str(out)])
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert "FORBIDDEN=[]" in r.stdout, r.stdout + r.stderr
    return r, json.loads(out.read_text())


def test_without_cuda_every_check_skips(tmp_path):
    r, doc = run_check(tmp_path, env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert set(doc["checks"]) == {"nccl_broadcast", "learner_step", "cuda_ipc"}
    assert all(c["status"] == "SKIP" for c in doc["checks"].values())
    assert r.stdout.count("SKIP ") == 3


@pytest.mark.slow
def test_cpu_smoke_runs_every_check(tmp_path):
    r, doc = run_check(tmp_path, "--cpu-smoke", env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    c = doc["checks"]
    assert {k: v["status"] for k, v in c.items()} == dict.fromkeys(c, "PASS"), r.stdout
    assert c["nccl_broadcast"]["backend"] == "gloo" and c["nccl_broadcast"]["bytes"] > 0
    step = c["learner_step"]
    assert step["loss_chunked"] == pytest.approx(step["loss_unchunked"], rel=2e-2)
    assert step["chunked"]["chunk_tokens"] == 8 and step["chunked"]["tokens_per_s"] > 0
    assert c["cuda_ipc"]["gb_per_s"] > 0
