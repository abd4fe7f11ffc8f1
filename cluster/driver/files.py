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


# ---------------------------------------------------------------------------------------------------------
# The policy (and the files the workers read) where the roles run

POLICY_ID_FILE = ".sonar-policy-id"
"""Written by the driver into a policy directory it materialised (``<run>/policy``): a random token per
run, so a probe on another node tells the run's own copy from a stale one left at the same path."""


def _probe_paths(paths: list[tuple[str, str, str | None]]) -> tuple[str, list[str]]:
    """On one node: for each (what, path, token), whether ``path`` is readable there (a directory with a
    config.json, or a file) and, with a token, holds this run's ``POLICY_ID_FILE``. Returns the node's
    address and the problems found."""
    import ray

    problems = []
    for what, path, token in paths:
        p = Path(path)
        if p.is_dir():
            if not (p / "config.json").is_file():
                problems.append(f"{what} {path}: no config.json")
            elif token is not None and ((p / POLICY_ID_FILE).read_text().strip()
                                        if (p / POLICY_ID_FILE).is_file() else None) != token:
                problems.append(f"{what} {path}: another run's copy (not the one the driver wrote)")
        elif not (p.is_file() and os.access(p, os.R_OK)):
            problems.append(f"{what} {path}: not readable")
    return ray.util.get_node_ip_address(), problems


def role_nodes(cfg, nodes: list[dict]) -> dict[str, list[str]]:
    """The alive nodes that could host the learner or a rollout worker, by node id -> roles: their total
    resources cover the role's GPUs and the custom resources ``cluster.role_resources`` gives it. (CPUs
    are not compared: a node with the role's GPUs and labels runs it once CPUs free up.)"""
    extra = cfg.cluster.role_resources
    asks = {"learner": {"GPU": cfg.learner.num_gpus, **extra.get("learner", {})},
            "rollout": {"GPU": cfg.rollout.num_gpus_per_worker, **extra.get("rollout", {})}}
    out: dict[str, list[str]] = {}
    for n in nodes:
        if not n.get("Alive"):
            continue
        have = n.get("Resources", {})
        for role, ask in asks.items():
            if all(have.get(k, 0.0) >= v for k, v in ask.items() if v > 0):
                out.setdefault(n["NodeID"], []).append(role)
    return out


def visibility_problems(results: dict[str, tuple[str, list[str], list[str]]]) -> list[str]:
    """``{node id: (address, roles, problems)}`` -> one line per node with problems (pure), ordered by
    address (node ids are random, so ordering by them would shuffle the message from run to run)."""
    return [f"{addr} (could run the {' and '.join(roles)}): {'; '.join(problems)}"
            for addr, roles, problems in sorted(results.values()) if problems]


def check_policy_visible(cfg, policy: str, token: str | None, probe=None) -> dict[str, list[str]]:
    """Before any role starts: the policy directory and the dataset files must be readable, as this run
    wrote them, on every alive node that could host the learner or a rollout worker. A Ray task pinned to
    each such node (no CPU) looks (``_probe_paths``). Raises RuntimeError naming each node, what it
    lacks and what to mount. Nodes the autoscaler has not started yet are checked by the roles themselves
    (``cluster.wire.policy`` names the node and the path). ``probe``: the remote function (tests of the
    message pass their own). Returns the nodes checked (id -> roles)."""
    import ray

    from sonar.cluster.wire.config import data_paths

    paths = [("policy directory", policy, token)]
    for i, st in enumerate(cfg.stages):
        paths += [(f"stages[{i}].data", p, None) for p in data_paths(st.data)]
    targets = role_nodes(cfg, ray.nodes())
    probe = probe or ray.remote(_probe_paths)
    refs = {nid: probe.options(**_pinned(nid)).remote(paths) for nid in targets}
    results = {nid: (*ray.get(ref, timeout=cfg.cluster.health_timeout_s), ) for nid, ref in refs.items()}
    lines = visibility_problems({nid: (addr, targets[nid], probs) for nid, (addr, probs) in results.items()})
    if lines:
        mounted = ("run.root (the driver writes the policy into <run>/policy there)" if token is not None
                   else "model.path")
        raise RuntimeError(
            f"the roles cannot read the run's files on {len(lines)} node(s): " + " | ".join(lines) +
            f". Mount shared storage at the same path on every node ({mounted}; the dataset files too): e.g. "
            "SONAR_RUN_ROOT=/runs on a ReadWriteMany volume as cluster/clusters/*.yaml do, with the model and data "
            "under /models and /data")
    return targets
