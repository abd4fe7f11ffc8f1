"""Atomic checkpoints that resume exactly.

Layout of a checkpoint directory ``<run>/checkpoints/<tag>/``::

    ds/            DeepSpeed engine state (model, optimizer, ZeRO partitions)
    hf/            the policy as a Hugging Face directory (transformers/vLLM load it; `sonar eval` too)
    state.json     Sonar state: policy version, stage index and step, data cursor, replay accounting
    rng.pt         rank 0's torch CPU / CUDA (when CUDA is present) / numpy / python RNG states
    rng-rank<r>.pt the same for data-parallel rank r > 0 (each rank restores its own; rng.pt if it has none)
    critic.pt      PPO's value model, when a stage runs ppo (``learner/critic.py``): its manifest, and its
                   whole state for a plain-PyTorch critic
    critic/        the DeepSpeed critic engine's state (every rank's partition)
    reference.pt   the stage's KL reference, in the training dtype, when a stage with a KL term runs
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

from sonar.cluster.wire.errors import RunFault

COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    pass


def rng_state() -> dict:
    """This process's RNG states: torch's CPU generator, every visible CUDA device's (``cuda``, only when
    CUDA is available: dropout and sampling on a GPU draw from those), numpy's and python's."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``'s result. A state without ``cuda`` (a checkpoint written before CUDA states
    were saved, or on a CPU machine) leaves the CUDA generators as they are; CUDA states for more devices
    than are visible restore the visible ones."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        for i, s in enumerate(list(cuda)[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def _rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-rank{rank}.pt"


class CheckpointWriteError(RunFault, OSError):
    """A checkpoint could not be written (a full disk, a quota, an I/O error): names the checkpoint, the
    cause and the free space left; its partial temporary directory was removed."""


def _fsync_file(p: Path) -> None:
    with open(p, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first (their entries)."""
    dirs = [root]
    for p in root.rglob("*"):
        if p.is_dir():
            dirs.append(p)
        elif p.is_file():
            _fsync_file(p)
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        _fsync_dir(d)


class _removed_on_failure:
    """On any failure inside (``torch.save``'s ``[enforce fail at inline_container.cc]`` on a full disk, an
    ``OSError``): remove the partial ``tmp`` (rank 0: the space it holds), raise ``CheckpointWriteError`` naming
    the checkpoint, the cause and the free space."""

    def __init__(self, tmp: Path, path: Path, rank: int):
        self.tmp, self.path, self.rank = tmp, path, rank

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or not isinstance(exc, Exception):
            return False
        if self.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            free = f"{shutil.disk_usage(self.path.parent).free / 2**30:.2f} GiB free"
        except OSError:
            free = "free space unknown"
        cause = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise CheckpointWriteError(f"checkpoint {self.path}: could not be written ({type(exc).__name__}: {cause}; "
                                   f"{free} on {self.path.parent}); its partial {self.tmp.name} was removed") from exc


def save_checkpoint(engine, path: str | Path, state: dict, write_extra=None, keep: int = 0,
                    rank: int = 0, world_size: int = 1, device="cpu", write_every_rank=None) -> str:
    """``write_extra(tmp_dir)`` (rank 0) adds files before the rename; ``write_every_rank(tmp_dir)`` runs on
    every rank after the engine's save, for what is collective (a ZeRO-3 gather of the Hugging Face export,
    the critic engine's save). ``keep`` > 0: afterwards, prune the checkpoints beside it to the newest
    ``keep`` (``prune_checkpoints``).

    Data parallel (``world_size`` > 1, every rank calls this with the same ``path``): every rank writes its
    DeepSpeed partition and its RNG state into rank 0's temporary directory; rank 0 alone writes the rest
    (state, ``write_extra``) and renames. Needs a directory every rank reaches (one node, or shared
    storage). ``device``: the learner's, where the ranks' collectives put their tensors (NCCL has no CPU
    backend)."""
    from sonar.learner.collectives import barrier, broadcast_object

    dp = (rank, world_size)
    path = Path(path)
    pid = broadcast_object(os.getpid(), 0, dp, device)
    tmp = path.with_name(f"{path.name}.tmp-{pid}")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier(dp, device)
    with _removed_on_failure(tmp, path, rank):
        engine.save_checkpoint(str(tmp / "ds"), tag="engine")
        if write_every_rank is not None:
            write_every_rank(tmp)
        torch.save(rng_state(), tmp / _rng_file(rank))
    barrier(dp, device)
    if rank != 0:
        barrier(dp, device)  # rank 0 renamed: the checkpoint exists when any rank returns
        return str(path)
    with _removed_on_failure(tmp, path, rank):
        (tmp / "state.json").write_text(json.dumps(state, default=_json_default, indent=1))
        if write_extra is not None:
            write_extra(tmp)
        (tmp / COMPLETE).write_text("ok\n")
        _fsync_tree(tmp)  # every byte on disk before the rename makes it the checkpoint (a power cut: old or new)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    latest = path.parent / "latest"
    latest_tmp = path.parent / f"latest.tmp-{os.getpid()}"
    latest_tmp.write_text(path.name + "\n")
    _fsync_file(latest_tmp)
    latest_tmp.replace(latest)
    _fsync_dir(path.parent)  # the two renames themselves
    if keep:
        prune_checkpoints(path.parent, keep)
    barrier(dp, device)
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


def load_checkpoint(engine, path: str | Path, rank: int = 0) -> dict:
    """The DeepSpeed state into ``engine``, the RNG states restored (``rank``'s own, else rank 0's), and
    the Sonar state returned."""
    path = validate_checkpoint(path)
    state = json.loads((path / "state.json").read_text())
    try:
        load_path, _ = engine.load_checkpoint(str(path / "ds"), tag="engine", load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint {str(path / 'ds')!r} could not be loaded: {e}") from e
    if load_path is None:
        raise CheckpointError(f"checkpoint {str(path / 'ds')!r} holds no DeepSpeed engine state")
    rng_path = path / _rng_file(rank)
    if not rng_path.is_file():
        rng_path = path / "rng.pt"  # a checkpoint of one rank, or one from before per-rank RNG files
    try:
        rng = torch.load(rng_path, weights_only=False)
        set_rng_state(rng)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {str(rng_path)!r} is corrupt: {e}") from None
    return state


def _run_identity(run_dir: Path) -> tuple[str | None, str | None]:
    """(run.name, tracking.experiment) of a run directory, from the config it saved (``config.yaml``);
    without a readable one, the name from the directory's own ``<name>-<YYYYmmdd>-<HHMMSS>-<pid>`` and no
    experiment (None for what cannot be told)."""
    import re

    import yaml

    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        saved = None
    if isinstance(saved, dict):
        run, tracking = saved.get("run") or {}, saved.get("tracking") or {}
        return run.get("name"), tracking.get("experiment")
    m = re.fullmatch(r"(.+)-\d{8}-\d{6}-\d+", run_dir.name)
    return (m.group(1) if m else None), None


def resolve_checkpoint(resume: str, runs_root: str, name: str | None = None, experiment: str | None = None) -> str:
    """``resume`` is a checkpoint directory, a run directory, or 'latest': the newest checkpoint (by its
    run's ``checkpoints/latest``) of the runs under ``runs_root`` that are runs of ``name`` (their saved
    ``run.name``) and, when ``experiment`` is given, of that ``tracking.experiment``: several experiments
    may share one root (``$SONAR_RUN_ROOT``), and each resumes its own. ``name`` None: any run."""
    p = Path(resume)
    if resume == "latest":
        found = sorted(Path(runs_root).glob("*/checkpoints/latest"), key=lambda x: x.stat().st_mtime)
        runs = [x for x in found
                if name is None or _matches(_run_identity(x.parent.parent), name, experiment)]
        if not runs:
            scope = "" if name is None else f" of a run named {name!r}" + (
                f" in tracking.experiment={experiment!r}" if experiment is not None else "")
            others = sorted({f"{n}" + (f" (experiment {e})" if e else "")
                             for n, e in (_run_identity(x.parent.parent) for x in found)})
            raise CheckpointError(f"resume='latest': no checkpoint under {str(runs_root)!r}{scope}"
                                  + (f" (runs with checkpoints there: {', '.join(others)}; set run.name to one, or "
                                     f"run.resume to a run or checkpoint directory)" if others else ""))
        latest = runs[-1]
        return str(latest.parent / latest.read_text().strip())
    if (p / "checkpoints" / "latest").exists():
        return str(p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip())
    if (p / "latest").exists() and not (p / COMPLETE).exists():
        return str(p / (p / "latest").read_text().strip())
    return str(validate_checkpoint(p))


def _matches(identity: tuple[str | None, str | None], name: str, experiment: str | None) -> bool:
    run_name, run_experiment = identity
    return run_name == name and (experiment is None or run_experiment == experiment)
