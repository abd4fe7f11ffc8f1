"""Kill a run mid-way (SIGKILL of its whole process tree), resume it from the latest checkpoint,
and check that the resumed run continues exactly: policy versions continue, no prompt is trained
twice, and the prompts that were in flight at the checkpoint are the first ones trained after it."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parent.parent


SFT_STEPS = 5
"""The SFT stage, shortened: the test is about the RL stage's checkpoint, resume and accounting."""


def kill_tree(pid):
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def read_jsonl(path):
    return [json.loads(l) for l in open(path)] if Path(path).exists() else []


def test_kill_and_resume_trains_every_prompt_once(tmp_path):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    common = ["--config", str(ROOT / "configs" / "smoke.yaml"), f"run.root={tmp_path}", "eval.before=false",
              "eval.no_search=false", "world.num_heldout_eval=4", "run.checkpoint_every=3", "rollout.num_workers=1",
              f"stages.0.steps={SFT_STEPS}"]
    proc = subprocess.Popen([sys.executable, "-m", "sonar", "train", *common, f"run.run_dir={a_dir}",
                             "stages.1.steps=1000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    log, ckpt = [], None
    deadline = time.monotonic() + 400
    try:
        for line in proc.stdout:
            log.append(line)
            # the second checkpoint inside the RL stage (run steps SFT_STEPS + 1.. are RL; every 3: 6, 9)
            if "checkpoint saved" in line and "/step" in line and int(line.rsplit("step", 1)[1]) >= SFT_STEPS + 4:
                ckpt = line.split("checkpoint saved: ")[1].strip()
                # Let the killed run train past the checkpoint: that work is lost.
                v_ckpt = json.loads((Path(ckpt) / "state.json").read_text())["version"]
                wait_until(lambda: any(r["version"] > v_ckpt for r in read_jsonl(a_dir / "trained_prompts.jsonl")),
                           max(1.0, deadline - time.monotonic()), f"a learner step past the checkpoint (v{v_ckpt})")
                break
            if time.monotonic() > deadline:
                break
    finally:
        kill_tree(proc.pid)
    assert ckpt, "".join(log[-40:])
    from sonar.learner.checkpoint import resolve_checkpoint

    ckpt = resolve_checkpoint(str(a_dir), str(tmp_path))  # the killed run may have saved more since
    state = json.loads((Path(ckpt) / "state.json").read_text())
    v0, step0 = state["version"], state["resume_step"]
    in_flight = state["replay"]["requeued_on_save"]

    resumed = subprocess.run([sys.executable, "-m", "sonar", "train", *common, f"run.run_dir={b_dir}",
                              f"run.resume={a_dir}", f"stages.1.steps={step0 + 8}"], cwd=ROOT, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    summary = json.loads((b_dir / "summary.json").read_text())

    # versions continue from the checkpoint: one per remaining step of this stage and the later ones
    from sonar.cluster.wire.config import load_config

    later = sum(st.steps for st in load_config([ROOT / "configs" / "smoke.yaml"]).stages[2:])
    assert summary["weights"]["learner"]["version"] == v0 + 8 + later
    before = [r for r in read_jsonl(a_dir / "trained_prompts.jsonl") if r["version"] <= v0]
    after = read_jsonl(b_dir / "trained_prompts.jsonl")
    assert min(r["version"] for r in after) == v0 + 1
    seen_before = [p for r in before for p in r["trained"] + r["dropped"]]
    seen_after = [p for r in after for p in r["trained"] + r["dropped"]]
    assert len(seen_before) == len(set(seen_before)) and len(seen_after) == len(set(seen_after))
    assert not set(seen_before) & set(seen_after), "a prompt was trained before and after the resume"
    # nothing in flight at the checkpoint is skipped: those prompts are served first after the resume
    assert set(in_flight) <= set(seen_after)
    assert summary["replay"]["balanced"]
    # the staleness bound still holds after the resume (versions and the replay's view agree)
    bound = load_config([ROOT / "configs" / "smoke.yaml"]).replay.max_policy_lag
    assert summary["policy_lag_max"] <= bound
