"""Checkpoints: atomic, complete or refused with the file named, and an exact round trip of model,
optimizer and RNG state through DeepSpeed."""
import json
import os

import pytest
import torch

from sonar.learner.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint, save_checkpoint
from tests.learner.test_train_step import init_deepspeed, tiny_model


def make_engine(seed=0):
    ds = init_deepspeed()
    from sonar.cluster.wire.config import LearnerConfig
    from sonar.learner.deepspeed_config import deepspeed_config

    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = ds.initialize(model=model, optimizer=opt, config=deepspeed_config(LearnerConfig(), on_gpu=False))
    return engine


def train_a_bit(engine, steps=2):
    for _ in range(steps):
        x = torch.randint(0, 40, (2, 6))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()


def test_round_trip_restores_model_optimizer_and_rng(tmp_path):
    a = make_engine()
    train_a_bit(a)
    torch.manual_seed(123)
    path = save_checkpoint(a, tmp_path / "ckpt" / "step2", {"version": 2, "cursor": [1, 2, 3]},
                           write_extra=lambda d: (d / "hf").mkdir())
    expected_next = torch.rand(3)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step2"
    assert not [p for p in os.listdir(tmp_path / "ckpt") if ".tmp-" in p]  # renamed into place
    b = make_engine(seed=1)  # different init: everything must come from the checkpoint
    state = load_checkpoint(b, path)
    assert state == {"version": 2, "cursor": [1, 2, 3]}
    assert torch.equal(torch.rand(3), expected_next)
    for (n, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), n
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"])
    x = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(7))
    for e in (a, b):  # the next step after the restore is the same step
        e.backward(e(input_ids=x, labels=x).loss)
        e.step()
    for (n, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), n
    assert (tmp_path / "ckpt" / "step2" / "hf").is_dir()


@pytest.mark.parametrize("damage, named", [
    ("COMPLETE", "COMPLETE is missing"),
    ("state.json", "state.json"),
    ("rng.pt", "rng.pt"),
])
def test_partial_or_corrupt_checkpoint_is_refused_naming_the_file(tmp_path, damage, named):
    engine = make_engine()
    path = save_checkpoint(engine, tmp_path / "c", {"version": 1})
    target = tmp_path / "c" / damage
    if damage == "COMPLETE":
        target.unlink()
    else:
        target.write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=named):
        load_checkpoint(make_engine(), path)


def test_missing_checkpoint_and_latest_resolution(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "nope"), str(tmp_path))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_checkpoint("latest", str(tmp_path))
    engine = make_engine()
    run = tmp_path / "run1"
    save_checkpoint(engine, run / "checkpoints" / "step4", {"version": 4})
    assert resolve_checkpoint(str(run), str(tmp_path)) == str(run / "checkpoints" / "step4")
    assert resolve_checkpoint("latest", str(tmp_path)) == str(run / "checkpoints" / "step4")


# -- run.keep_checkpoints: pruning -----------------------------------------------------------------

def fake_checkpoint(root, name, t_ns, complete=True):
    """A directory shaped like a checkpoint whose COMPLETE marker was written at ``t_ns``."""
    p = root / name
    (p / "ds").mkdir(parents=True)
    (p / "state.json").write_text("{}")
    if complete:
        (p / "COMPLETE").write_text("ok\n")
        os.utime(p / "COMPLETE", ns=(t_ns, t_ns))
    return p


def test_prune_keeps_the_newest_complete_and_never_touches_partial_or_in_progress(tmp_path):
    from sonar.learner.checkpoint import complete_checkpoints, prune_checkpoints

    root = tmp_path / "checkpoints"
    # names sort the other way round from their completion times: order is by COMPLETE, not name
    for i, name in enumerate(["step9", "step7", "stage0", "step3"]):
        fake_checkpoint(root, name, 1_000_000_000 * (i + 1))
    writing = fake_checkpoint(root, "step11.tmp-4242", 9_000_000_000)  # being written (has COMPLETE already)
    partial = fake_checkpoint(root, "step5", 0, complete=False)
    (root / "latest").write_text("step3\n")
    assert [p.name for p in complete_checkpoints(root)] == ["step9", "step7", "stage0", "step3"]
    deleted = prune_checkpoints(root, keep=2)
    assert sorted(os.path.basename(d) for d in deleted) == ["step7", "step9"]
    assert sorted(p.name for p in root.iterdir()) == sorted(["stage0", "step3", writing.name, partial.name, "latest"])
    assert prune_checkpoints(root, keep=0) == [] and prune_checkpoints(root, keep=2) == []


def test_prune_never_deletes_the_checkpoint_latest_names(tmp_path):
    from sonar.learner.checkpoint import prune_checkpoints

    root = tmp_path / "checkpoints"
    for i, name in enumerate(["a", "b", "c"]):
        fake_checkpoint(root, name, 1_000_000_000 * (i + 1))
    (root / "latest").write_text("a\n")  # oldest by time, but the one a resume would load
    prune_checkpoints(root, keep=1)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["a", "c"]


def test_save_checkpoint_with_keep_leaves_the_newest_and_resume_finds_it(tmp_path):
    engine = make_engine()
    run = tmp_path / "run1"
    for step in (2, 4, 6):
        train_a_bit(engine, 1)
        save_checkpoint(engine, run / "checkpoints" / f"step{step}", {"version": step}, keep=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step4", "step6"]
    assert resolve_checkpoint(str(run), str(tmp_path)) == str(run / "checkpoints" / "step6")
    assert load_checkpoint(make_engine(), run / "checkpoints" / "step4")["version"] == 4  # intact


def test_keep_checkpoints_is_validated():
    from sonar.cluster.wire.config import load_config

    assert load_config([], ["run.keep_checkpoints=3"]).run.keep_checkpoints == 3
    with pytest.raises(ValueError, match=r"run\.keep_checkpoints=-1"):
        load_config([], ["run.keep_checkpoints=-1"])


def test_a_full_disk_mid_save_leaves_no_partial_and_names_the_cause(tmp_path, monkeypatch):
    """Issue 54, finding 5: a full disk during a checkpoint raised torch's ``[enforce fail at
    inline_container.cc:672]`` and left the ``.tmp-<pid>`` directory holding the space."""
    from sonar.learner import checkpoint

    engine = make_engine()
    real = torch.save

    def full_disk(obj, f, *a, **k):
        if str(f).endswith("rng.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"step3: could not be written \(RuntimeError: "
                                                              r"\[enforce fail.*GiB free on .*partial step3\.tmp-"):
        save_checkpoint(engine, tmp_path / "ckpt" / "step3", {"version": 3})
    assert os.listdir(tmp_path / "ckpt") == []  # the partial directory is gone
    monkeypatch.setattr(checkpoint.torch, "save", real)
    synced = []
    monkeypatch.setattr(checkpoint, "_fsync_file", lambda p: synced.append(p.name))
    save_checkpoint(engine, tmp_path / "ckpt" / "step3", {"version": 3})
    assert {"state.json", "COMPLETE", "rng.pt"} <= set(synced)  # on disk before the rename


@pytest.fixture
def small_disk(tmp_path):
    """A real file system that fills: a 1 MiB tmpfs mounted under ``tmp_path`` (root only; skipped where
    mounting is not allowed), unmounted after the test."""
    import subprocess

    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_checkpoint_on_a_disk_that_fills_names_the_path_and_frees_the_space(small_disk):
    """The same finding on a real full disk: the checkpoint's directory sits on a 1 MiB tmpfs that a filler
    file leaves 16 KiB of, less than the tiny model's checkpoint. The save fails with ``CheckpointWriteError``
    naming the checkpoint and the space left, removes its partial directory (the space comes back), and a
    save after the filler is gone succeeds."""
    from sonar.learner import checkpoint

    engine = make_engine()
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * (free - 16 * 1024))
    before = os.statvfs(small_disk).f_bavail
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match=rf"checkpoint {small_disk / 'ckpt' / 'step3'}: could not be written \("):
        save_checkpoint(engine, small_disk / "ckpt" / "step3", {"version": 3})
    assert os.listdir(small_disk / "ckpt") == []  # the partial directory is gone
    assert os.statvfs(small_disk).f_bavail == before  # and its space with it
    filler.unlink()
    save_checkpoint(engine, small_disk / "ckpt" / "step3", {"version": 3})
    assert (small_disk / "ckpt" / "step3" / "COMPLETE").exists()
