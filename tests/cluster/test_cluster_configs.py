"""The shipped Ray cluster-launcher configs are valid for the pinned Ray (its own schema), and every shipped
cluster file runs Ray with token authentication (issue 26): ``RAY_AUTH_MODE=token`` on every node, the token
from a Secret or a file outside the repository (never in the file), the dashboard never reachable beyond
its host or pod without it; ``RAY_AUTH_MODE=disabled`` only on the loopback fake cluster."""
import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml

ALL = sorted((Path(__file__).resolve().parents[2] / "cluster" / "clusters").glob("*.yaml"))
KUBERAY = [p for p in ALL if p.name.startswith("kuberay-")]
"""KubeRay custom resources (RayCluster, RayJob), not cluster-launcher configs: test_cluster_fit.py
checks them against the CRD's fields and Ray's own KubeRay autoscaling-config derivation."""
CLUSTERS = [p for p in ALL if p not in KUBERAY]
LOOPBACK = {"local-fake.yaml"}
"""Files whose nodes are processes on this machine (provider fake_multinode): the only place auth may be off."""


def test_every_shipped_file_is_checked_somewhere():
    assert {p.name for p in KUBERAY} == {"kuberay-cluster.yaml", "kuberay-job.yaml"}
    assert {p.name for p in CLUSTERS} >= {"aws.yaml", "gcp.yaml", "local-fake.yaml"}
    for p in KUBERAY:
        assert yaml.safe_load(p.read_text())["kind"] in ("RayCluster", "RayJob"), p.name


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_cluster_config_validates_against_rays_schema(path):
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    cfg = yaml.safe_load(path.read_text())
    if cfg["provider"]["type"] == "fake_multinode":
        validate_config(cfg)  # complete as written: the wheel ships no defaults for this provider
    else:
        validate_config(fillout_defaults(cfg))
    assert cfg["head_node_type"] in cfg["available_node_types"]
    assert not re.search(r"^\s*(password|api_key|token)\s*:", path.read_text(), re.I | re.M)  # secrets: env only


# ------------------------------------------------------------------------------------------- token auth

LOOPBACK_HOSTS = {"127.0.0.1", "localhost"}


def strings(obj):
    """Every string value in a parsed YAML document (commands, docker options, env values)."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def env_entries(obj):
    """Every Kubernetes env entry ({name, value | valueFrom}) in a parsed document."""
    if isinstance(obj, dict):
        if isinstance(obj.get("name"), str) and ("value" in obj or "valueFrom" in obj):
            yield obj
        for v in obj.values():
            yield from env_entries(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from env_entries(v)


def docker_env(options: list[str]) -> dict[str, str]:
    words = [w for o in options for w in shlex.split(o)]
    return dict(w.split("=", 1) for flag, w in zip(words, words[1:]) if flag in ("-e", "--env"))


def launcher_problems(doc: dict) -> list[str]:
    """Token auth on a cluster-launcher file: every node's container has RAY_AUTH_MODE=token and a token
    file that file_mounts brings to every node; the dashboard binds the head's loopback."""
    errs = []
    docker = doc.get("docker")
    if not docker:
        return ["no docker section: the nodes' Ray environment is not set for every node"]
    mounts = [m.removeprefix("~/") for m in doc.get("file_mounts", {})]
    for name, t in doc["available_node_types"].items():
        opts = {**docker, **t.get("docker", {})}
        key = "head_run_options" if name == doc["head_node_type"] else "worker_run_options"
        env = docker_env(opts.get("run_options", []) + opts.get(key, []))
        if env.get("RAY_AUTH_MODE") != "token":
            errs.append(f"{name}: RAY_AUTH_MODE={env.get('RAY_AUTH_MODE')}, not token")
        path = env.get("RAY_AUTH_TOKEN_PATH", "")
        if not any(path.endswith(f"/{m}/auth_token") for m in mounts):
            errs.append(f"{name}: RAY_AUTH_TOKEN_PATH={path!r} is not a file that file_mounts copies to every node")
    for cmd in doc.get("head_start_ray_commands", []):
        host = re.search(r"--dashboard-host[= ](\S+)", cmd)
        if "ray start --head" in cmd and (host is None or host[1] not in LOOPBACK_HOSTS):
            errs.append(f"head: the dashboard listens on {host[1] if host else 'the default'}, not 127.0.0.1")
    return errs


def kuberay_problems(spec: dict) -> list[str]:
    """Token auth on a RayCluster spec: authOptions with the Secret, and every Ray container naming it."""
    errs = []
    auth = spec.get("authOptions") or {}
    secret = auth.get("secretName")
    if auth.get("mode", "token" if auth else "disabled") != "token" or not secret:
        errs.append(f"authOptions={auth}: needs mode token and the Secret's secretName")
    pods = [("head", spec["headGroupSpec"]["template"]["spec"])] + [
        (g["groupName"], g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]
    for name, pod in pods:
        env = {e["name"]: e for e in pod["containers"][0].get("env", [])}
        if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
            errs.append(f"{name}: RAY_AUTH_MODE is not token")
        ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
        if ref != {"name": secret, "key": "auth_token"}:
            errs.append(f"{name}: RAY_AUTH_TOKEN is not the Secret {secret!r}'s auth_token ({ref})")
    host = spec["headGroupSpec"].get("rayStartParams", {}).get("dashboard-host", "0.0.0.0")  # KubeRay's default
    if host not in LOOPBACK_HOSTS and errs:
        errs.append(f"the dashboard listens on {host} without token auth")
    return errs


def auth_problems(name: str, doc: dict, shipped: dict[str, dict]) -> list[str]:
    """Where a cluster file leaves Ray's token auth off or puts a token in the file; [] when it keeps to it.
    ``shipped``: every shipped file by name (a RayJob is checked through the RayCluster it selects)."""
    errs = []
    for s in strings(doc):
        mode = re.search(r"RAY_AUTH_MODE=(\S*)", s)
        if mode and mode[1] != "token" and name not in LOOPBACK:
            errs.append(f"sets RAY_AUTH_MODE={mode[1]}")
        if re.search(r"RAY_AUTH_TOKEN=", s):
            errs.append("a token in the file (RAY_AUTH_TOKEN=...): take it from a Secret or a file")
    for e in env_entries(doc):
        if e["name"] == "RAY_AUTH_MODE" and e.get("value") != "token" and name not in LOOPBACK:
            errs.append(f"env RAY_AUTH_MODE={e.get('value')}")
        if e["name"] == "RAY_AUTH_TOKEN" and "value" in e:
            errs.append("a token in the file (env RAY_AUTH_TOKEN value): take it from a Secret")
    kind = doc.get("kind")
    if kind == "RayCluster":
        errs += kuberay_problems(doc["spec"])
    elif kind == "RayJob":
        s = doc["spec"]
        if "rayClusterSpec" in s:
            errs += kuberay_problems(s["rayClusterSpec"])
        else:
            target = [n for n, d in shipped.items() if d.get("kind") == "RayCluster"
                      and s.get("clusterSelector") == {"ray.io/cluster": d["metadata"]["name"]}]
            if not target:
                errs.append(f"clusterSelector {s.get('clusterSelector')} selects no shipped RayCluster")
    elif doc["provider"]["type"] == "fake_multinode":
        if name not in LOOPBACK:
            errs.append("a fake cluster not listed as loopback")
    else:
        errs += launcher_problems(doc)
    return errs


def shipped() -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in ALL}


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_every_shipped_cluster_file_runs_ray_with_token_auth(path):
    docs = shipped()
    assert auth_problems(path.name, docs[path.name], docs) == []


def test_auth_is_off_only_on_the_loopback_cluster():
    """local-fake.yaml's nodes are processes on this machine (fake_multinode): the one file where the
    environment `ray up` runs in may say RAY_AUTH_MODE=disabled (its header says so); no other file does."""
    for p in ALL:
        says_disabled = bool(re.search(r"RAY_AUTH_MODE\W+(?:value\W+)?disabled", p.read_text()))
        assert says_disabled == (p.name in LOOPBACK), p.name
    assert yaml.safe_load((ALL[0].parent / "local-fake.yaml").read_text())["provider"]["type"] == "fake_multinode"


def test_the_auth_check_can_fail():
    docs = shipped()
    aws = copy.deepcopy(docs["aws.yaml"])  # the former files: auth disabled on the start commands
    aws["docker"]["run_options"] = [o for o in aws["docker"]["run_options"] if "RAY_AUTH" not in o]
    aws["head_start_ray_commands"][1] = "RAY_AUTH_MODE=disabled " + aws["head_start_ray_commands"][1].replace(
        "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
    errs = auth_problems("aws.yaml", aws, docs)
    assert "sets RAY_AUTH_MODE=disabled" in errs
    assert "head: RAY_AUTH_MODE=None, not token" in errs and "cpu_worker: RAY_AUTH_MODE=None, not token" in errs
    assert "head: the dashboard listens on 0.0.0.0, not 127.0.0.1" in errs
    literal = copy.deepcopy(docs["gcp.yaml"])
    literal["docker"]["run_options"].append("-e RAY_AUTH_TOKEN=0123abcd")
    assert auth_problems("gcp.yaml", literal, docs) == [
        "a token in the file (RAY_AUTH_TOKEN=...): take it from a Secret or a file"]
    kr = copy.deepcopy(docs["kuberay-cluster.yaml"])  # the former manifest: disabled, dashboard on 0.0.0.0
    del kr["spec"]["authOptions"]
    gpu = kr["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    gpu["env"] = [{"name": "RAY_AUTH_MODE", "value": "disabled"}, {"name": "RAY_AUTH_TOKEN", "value": "abc"}]
    errs = auth_problems("kuberay-cluster.yaml", kr, docs)
    assert "env RAY_AUTH_MODE=disabled" in errs
    assert "a token in the file (env RAY_AUTH_TOKEN value): take it from a Secret" in errs
    assert "authOptions={}: needs mode token and the Secret's secretName" in errs
    assert "gpu-group: RAY_AUTH_MODE is not token" in errs and "the dashboard listens on 0.0.0.0 without token auth" in errs
    job = copy.deepcopy(docs["kuberay-job.yaml"])
    job["spec"]["clusterSelector"] = {"ray.io/cluster": "elsewhere"}
    assert auth_problems("kuberay-job.yaml", job, docs) == [
        "clusterSelector {'ray.io/cluster': 'elsewhere'} selects no shipped RayCluster"]
    assert auth_problems("other-fake.yaml", docs["local-fake.yaml"], docs) == ["a fake cluster not listed as loopback"]
