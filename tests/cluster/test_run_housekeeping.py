"""The run's housekeeping: a resume target checked before anything starts (existence, matching config),
metrics on disk as they are logged, and a history that does not grow with the run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sonar.cluster.driver import run as R
from sonar.cluster.driver.tracking import NullSink
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import load_config, to_yaml

ROOT = Path(__file__).resolve().parents[2]


def fake_run_with_checkpoint(root: Path, cfg, name="a", tag="step3") -> Path:
    run_dir = root / name
    ck = run_dir / "checkpoints" / tag
    (ck / "ds").mkdir(parents=True)
    for f, text in (("COMPLETE", "ok\n"), ("state.json", "{}"), ("rng.pt", "")):
        (ck / f).write_text(text)
    (run_dir / "checkpoints" / "latest").write_text(tag + "\n")
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return ck


def test_resume_latest_without_a_checkpoint_fails_before_a_run_directory_exists(tmp_path):
    cfg = load_config([], [f"run.root={tmp_path / 'runs'}", "run.resume=latest"])
    with pytest.raises(R.ResumeError, match=r"run\.resume='latest': .*no checkpoint under"):
        R.start_run(cfg)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_cli_resume_latest_without_a_checkpoint_is_one_line_and_leaves_nothing(tmp_path):
    p = subprocess.run([sys.executable, "-m", "sonar", "train", f"run.root={tmp_path}", "run.resume=latest"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("sonar: resume error: run.resume='latest'"), p.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []  # no run directory, no mlflow.db
    assert "ray" not in p.stderr.lower() and "Started a local Ray" not in p.stdout


def test_a_checkpoint_from_another_config_is_refused_naming_the_fields(tmp_path):
    saved = load_config([], [f"run.root={tmp_path}"])
    ck = fake_run_with_checkpoint(tmp_path, saved)
    other = load_config([], [f"run.root={tmp_path}", "run.resume=latest", f"model.hidden_size={saved.model.hidden_size * 2}",
                             f"world.seed={saved.world.seed + 1}"])
    with pytest.raises(R.ResumeError) as e:
        R.resolve_resume(other)
    msg = str(e.value)
    assert "\n" not in msg and str(ck) in msg
    assert f"model.hidden_size: checkpoint {saved.model.hidden_size}, now {saved.model.hidden_size * 2}" in msg
    assert f"world.seed: checkpoint {saved.world.seed}, now {saved.world.seed + 1}" in msg
    assert "run.root" not in msg  # only the fields that matter
    # a stage's length, the seed of the run and where it runs may change
    same = load_config([], [f"run.root={tmp_path}", f"run.resume={tmp_path / 'a'}", "stages.0.steps=999",
                            "run.seed=5", f"run.run_dir={tmp_path / 'b'}"])
    assert R.resolve_resume(same) == str(ck)


def test_a_different_number_of_stages_is_named(tmp_path):
    saved = load_config([ROOT / "configs" / "smoke.yaml"], [f"run.root={tmp_path}"])
    fake_run_with_checkpoint(tmp_path, saved)
    fewer = load_config([], [f"run.root={tmp_path}", "run.name=smoke", "run.resume=latest"])
    with pytest.raises(R.ResumeError, match=f"stages: checkpoint has {len(saved.stages)} stages, now {len(fewer.stages)}"):
        R.resolve_resume(fewer)


def _aged(ck: Path, t: int) -> Path:
    """Give the run of checkpoint ``ck`` a ``checkpoints/latest`` written at time ``t`` (what 'latest' orders by)."""
    import os

    os.utime(ck.parent / "latest", (t, t))
    return ck


def test_resume_latest_resumes_its_own_run_name_and_experiment_under_a_shared_root(tmp_path):
    """One root (a shared $SONAR_RUN_ROOT), runs of two experiments: each resume=latest finds its own
    run's checkpoint, even when the other's is newer; the same run.name in two experiments is told apart
    by tracking.experiment when it is set."""
    def cfg(name, experiment, *extra):
        return load_config([], [f"run.root={tmp_path}", f"run.name={name}", f"tracking.experiment={experiment}",
                                *extra])
    alpha = _aged(fake_run_with_checkpoint(tmp_path, cfg("alpha", "exp-a"), "alpha-20261201-100000-11"), 1000)
    beta = _aged(fake_run_with_checkpoint(tmp_path, cfg("beta", "exp-b"), "beta-20261201-110000-12"), 2000)
    shared_a = _aged(fake_run_with_checkpoint(tmp_path, cfg("shared", "exp-a"), "shared-20261201-120000-13"), 3000)
    shared_b = _aged(fake_run_with_checkpoint(tmp_path, cfg("shared", "exp-b"), "shared-20261201-130000-14"), 4000)
    assert R.resolve_resume(cfg("alpha", "exp-a", "run.resume=latest")) == str(alpha)  # not the newer beta
    assert R.resolve_resume(cfg("beta", "exp-b", "run.resume=latest")) == str(beta)  # not the newer shared runs
    assert R.resolve_resume(cfg("shared", "exp-a", "run.resume=latest")) == str(shared_a)  # not exp-b's, newer
    assert R.resolve_resume(cfg("shared", "exp-b", "run.resume=latest")) == str(shared_b)
    # no experiment set: the newest run of the name, whichever experiment
    anyexp = load_config([], [f"run.root={tmp_path}", "run.name=shared", "run.resume=latest"])
    assert R.resolve_resume(anyexp) == str(shared_b)
    # a name with no run there: one line naming the name, the experiment, the root and what is there
    with pytest.raises(R.ResumeError) as e:
        R.resolve_resume(cfg("gamma", "exp-a", "run.resume=latest"))
    msg = str(e.value)
    assert "\n" not in msg and "run named 'gamma'" in msg and "tracking.experiment='exp-a'" in msg
    assert repr(str(tmp_path)) in msg and "alpha (experiment exp-a)" in msg and "shared (experiment exp-b)" in msg
    with pytest.raises(R.ResumeError, match="run named 'alpha' in tracking.experiment='exp-b'"):
        R.resolve_resume(cfg("alpha", "exp-b", "run.resume=latest"))


def test_resume_latest_tells_a_run_without_a_saved_config_by_its_directory_name(tmp_path):
    """A run directory without config.yaml (an older layout) is matched by its ``<name>-<date>-<time>-<pid>``;
    'alpha' is not a run of 'alpha-x' nor the other way round."""
    from sonar.learner.checkpoint import resolve_checkpoint

    base = load_config([], [f"run.root={tmp_path}"])
    mine = _aged(fake_run_with_checkpoint(tmp_path, base, "alpha-20261201-100000-7"), 1000)
    other = _aged(fake_run_with_checkpoint(tmp_path, base, "alpha-x-20261201-110000-8"), 2000)
    for ck in (mine, other):
        (ck.parent.parent / "config.yaml").unlink()
    assert resolve_checkpoint("latest", str(tmp_path), name="alpha") == str(mine)
    assert resolve_checkpoint("latest", str(tmp_path), name="alpha-x") == str(other)
    assert resolve_checkpoint("latest", str(tmp_path)) == str(other)  # no name: the newest of all


def test_a_partial_checkpoint_is_refused_before_start(tmp_path):
    saved = load_config([], [f"run.root={tmp_path}"])
    ck = fake_run_with_checkpoint(tmp_path, saved)
    (ck / "COMPLETE").unlink()
    with pytest.raises(R.ResumeError, match="COMPLETE is missing"):
        R.resolve_resume(load_config([], [f"run.resume={ck}"]))


def test_metrics_are_on_disk_as_logged_and_the_history_is_a_bounded_window(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "HISTORY_WINDOW", 7)
    run = R.Run(load_config([], []), tmp_path, NullSink())
    rows = []
    for i in range(25):
        run.step = i
        m = {K.LEARNER_POLICY_LAG_MAX: (i * 7) % 11, K.LEARNER_VERSION: i, "stage": 1, "note": "text is not a metric"}
        if i % 2:
            m.update({K.ROLLOUT_TRAJECTORIES: 8.0, K.LEARNER_TOKENS_PER_S: 100.0 + i})
        run.log(m)
        rows.append({"step": i, **{k: v for k, v in m.items() if k != "note"}})
        on_disk = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert on_disk == rows  # every row is on disk when log returns, before finish
    assert len(run.history) == 7 and list(run.history) == rows[-7:]
    assert run.history_since(22) == rows[-3:] and run.history_since(25) == []
    # the summary's aggregates cover every row, not only the window (loop references)
    rl = [r for r in rows if K.ROLLOUT_TRAJECTORIES in r]
    assert run.totals.policy_lag_max == max(r[K.LEARNER_POLICY_LAG_MAX] for r in rows) == 10
    assert run.totals.learner_steps == 25
    assert run.totals.tokens_per_s_mean == pytest.approx(sum(r[K.LEARNER_TOKENS_PER_S] for r in rl) / len(rl))
    run.finish("FINISHED")
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 25
