"""Files across nodes: does the driver see what the learner writes, and the upload path when it does not.

The learner writes checkpoints and the Hugging Face export under ``run.dir`` on its own node; the driver
logs them (MLflow artifacts, ``summary.json``) from its node. On one node, or with ``run.root`` on shared
storage (NFS, EFS, Filestore), both see the same files. ``check_run_dir`` finds out at start on a
multi-node cluster: a Ray task pinned to the learner's node writes a probe file into ``run.dir`` and the
driver looks for it. When it is missing, ``cluster.upload_files=false`` fails the run there, naming the
directory; ``true`` makes ``fetch_dir`` stream each checkpoint and the export from the learner's node
into the driver's ``run.dir`` after every save (a streaming Ray task: chunks of ``CHUNK_BYTES`` through
the object store, so neither side holds a whole model in memory).
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

CHUNK_BYTES = 16 << 20
"""Bytes per chunk of an upload (each one object in Ray's object store)."""


def _pinned(node_id: str, **options):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return dict(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **options)


def _write_probe(path: str, token: str) -> str:
    import ray

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(token)
    return ray.util.get_node_ip_address()


def _read_dir(path: str, chunk_bytes: int):
    """Yields (relative path, offset, bytes) for every file under ``path``, in order, chunk by chunk
    (an empty file yields one empty chunk)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{path}: no such directory on this node")
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = str(f.relative_to(root))
        with open(f, "rb") as fh:
            off = 0
            while True:
                data = fh.read(chunk_bytes)
                if data or off == 0:
                    yield rel, off, data
                if len(data) < chunk_bytes:
                    break
                off += len(data)


def check_run_dir(cfg, learner_node: str, run_dir: Path) -> bool:
    """Whether the driver sees what the learner's node writes under ``run_dir`` (module docstring).
    Not seen and ``cluster.upload_files`` false: RuntimeError naming the directory and the remedies."""
    import ray

    probe = Path(run_dir) / f".learner-probe-{uuid.uuid4().hex[:8]}"
    token = uuid.uuid4().hex
    where = ray.get(ray.remote(_write_probe).options(**_pinned(learner_node)).remote(str(probe), token),
                    timeout=cfg.cluster.health_timeout_s)
    try:
        seen = probe.is_file() and probe.read_text() == token
    finally:
        probe.unlink(missing_ok=True)
    if not seen and not cfg.cluster.upload_files:
        raise RuntimeError(f"the learner's node ({where}) writes checkpoints and the export under run.dir={run_dir}, "
                           "which the driver cannot see there: put run.root on storage every node shares, or set "
                           "cluster.upload_files=true to stream them to the driver")
    return seen


def fetch_dir(node_id: str, remote: str, local: str, chunk_bytes: int = CHUNK_BYTES) -> str:
    """Copy the directory ``remote`` on node ``node_id`` to ``local`` on this machine (replaced whole:
    written beside it, then renamed). Returns ``local``."""
    import ray

    local_p = Path(local)
    tmp = local_p.with_name(local_p.name + f".upload-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    gen = ray.remote(_read_dir).options(**_pinned(node_id, num_returns="streaming")).remote(remote, chunk_bytes)
    for ref in gen:
        rel, off, data = ray.get(ref)
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(dst, "r+b" if off else "wb") as fh:
            fh.seek(off)
            fh.write(data)
    tmp.mkdir(parents=True, exist_ok=True)  # an empty directory is still one
    if local_p.exists():
        shutil.rmtree(local_p)
    tmp.rename(local_p)
    return str(local_p)
