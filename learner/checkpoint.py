"""Atomic checkpoints that resume exactly.

Layout of a checkpoint directory ``<run>/checkpoints/<tag>/``::

    ds/            DeepSpeed engine state (model, optimizer, ZeRO partitions)
    hf/            the policy as a Hugging Face directory (transformers/vLLM load it; `sonar eval` too)
    state.json     Sonar state: policy version, stage index and step, data cursor, replay accounting
    rng.pt         torch / numpy / python RNG states
    critic.pt      PPO's value model (trunk, head, AdamW state), when a stage runs ppo (``learner/critic.py``)
    COMPLETE       written last; a directory without it is partial and refused

A checkpoint is written to ``<tag>.tmp-<pid>`` and renamed into place, so a crash mid-save never
leaves something that looks complete. ``<run>/checkpoints/latest`` names the newest tag.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(engine, path: str | Path, state: dict, write_extra=None, keep: int = 0,
                    rank: int = 0, world_size: int = 1) -> str:
    """``write_extra(tmp_dir)`` adds files (the Hugging Face export under ``hf/``) before the rename.
    ``keep`` > 0: afterwards, prune the checkpoints beside it to the newest ``keep`` (``prune_checkpoints``).

    Data parallel (``world_size`` > 1, every rank calls this with the same ``path``): every rank writes its
    DeepSpeed partition into rank 0's temporary directory; rank 0 alone writes the rest (RNG, state,
    ``write_extra``) and renames. Needs a directory every rank reaches (one node, or shared storage)."""
    import torch.distributed as dist

    path = Path(path)
    pid = os.getpid()
    if world_size > 1:
        box = [pid]
        dist.broadcast_object_list(box, src=0)
        pid = box[0]
    tmp = path.with_name(f"{path.name}.tmp-{pid}")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if world_size > 1:
        dist.barrier()
    engine.save_checkpoint(str(tmp / "ds"), tag="engine")
    if world_size > 1:
        dist.barrier()
    if rank != 0:
        dist.barrier()  # rank 0 renamed: the checkpoint exists when any rank returns
        return str(path)
    (tmp / "state.json").write_text(json.dumps(state, default=_json_default, indent=1))
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               tmp / "rng.pt")
    if write_extra is not None:
        write_extra(tmp)
    (tmp / COMPLETE).write_text("ok\n")
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    latest = path.parent / "latest"
    latest_tmp = path.parent / f"latest.tmp-{os.getpid()}"
    latest_tmp.write_text(path.name + "\n")
    latest_tmp.replace(latest)
    if keep:
        prune_checkpoints(path.parent, keep)
    if world_size > 1:
        dist.barrier()
    return str(path)


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints in ``root`` (a run's ``checkpoints/``), oldest first (by the time their
    ``COMPLETE`` marker was written). Directories being written (``<tag>.tmp-<pid>``) and partial
    ones are not listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and ".tmp-" not in p.name and ".deleting-" not in p.name
             and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: ((p / COMPLETE).stat().st_mtime_ns, p.name))


def prune_checkpoints(root: str | Path, keep: int) -> list[str]:
    """Delete the oldest complete checkpoints in ``root`` beyond the newest ``keep`` (0: keep all).
    The one ``latest`` names is never deleted, nor anything that is not complete (a checkpoint being
    written, a partial one: those are left for a human). Returns the deleted paths."""
    if keep <= 0:
        return []
    root = Path(root)
    ckpts = complete_checkpoints(root)
    try:
        latest = (root / "latest").read_text().strip()
    except OSError:
        latest = None
    doomed = [p for p in ckpts[:max(0, len(ckpts) - keep)] if p.name != latest]
    for p in doomed:
        # Renamed first, so a crash mid-delete leaves a non-checkpoint name, never a half-deleted "complete" one.
        trash = p.with_name(f"{p.name}.deleting-{os.getpid()}")
        p.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    return [str(p) for p in doomed]


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def validate_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist or is not a directory")
    for name in (COMPLETE, "state.json", "rng.pt", "ds"):
        if not (path / name).exists():
            raise CheckpointError(f"checkpoint {str(path)!r} is partial or corrupt: {name} is missing")
    try:
        json.loads((path / "state.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint file {str(path / 'state.json')!r} is corrupt: {e}") from None
    return path


def read_state(path: str | Path) -> dict:
    """The Sonar state (``state.json``) of a complete checkpoint."""
    return json.loads((validate_checkpoint(path) / "state.json").read_text())


def load_checkpoint(engine, path: str | Path) -> dict:
    path = validate_checkpoint(path)
    state = json.loads((path / "state.json").read_text())
    try:
        load_path, _ = engine.load_checkpoint(str(path / "ds"), tag="engine", load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint {str(path / 'ds')!r} could not be loaded: {e}") from e
    if load_path is None:
        raise CheckpointError(f"checkpoint {str(path / 'ds')!r} holds no DeepSpeed engine state")
    try:
        rng = torch.load(path / "rng.pt", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {str(path / 'rng.pt')!r} is corrupt: {e}") from None
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return state


def resolve_checkpoint(resume: str, runs_root: str) -> str:
    """``resume`` is a checkpoint directory, a run directory, or 'latest' (newest run under runs_root)."""
    p = Path(resume)
    if resume == "latest":
        runs = sorted(Path(runs_root).glob("*/checkpoints/latest"), key=lambda x: x.stat().st_mtime)
        if not runs:
            raise CheckpointError(f"resume='latest': no checkpoint under {runs_root!r}")
        latest = runs[-1]
        return str(latest.parent / latest.read_text().strip())
    if (p / "checkpoints" / "latest").exists():
        return str(p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip())
    if (p / "latest").exists() and not (p / COMPLETE).exists():
        return str(p / (p / "latest").read_text().strip())
    return str(validate_checkpoint(p))
