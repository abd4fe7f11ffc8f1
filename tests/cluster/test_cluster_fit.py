"""The cluster files can host the presets: every preset's resource requests (``demands.role_demands``: the
learner's ranks as its placement group, each rollout worker, each retrieval replica) are fed to Ray's
autoscaler node selection (``ResourceDemandScheduler.get_nodes_to_launch``, the v1 scheduler the cluster
launcher and KubeRay's in-tree autoscaler run) with each file's node types, starting from the head alone;
launches are repeated until it asks for nothing more, and every request must then be placed within the
file's max_workers. The KubeRay manifest goes through Ray's own translation of a RayCluster into node
types, and both manifests are checked against the KubeRay CRD's field names. Pure: no Ray cluster."""
import copy
import json
from pathlib import Path

import pytest
import yaml

from sonar.cluster.driver.demands import Demands, role_demands, total
from sonar.cluster.wire.config import CONFIG_DIR, load_config

CLUSTERS = Path(__file__).resolve().parents[2] / "cluster" / "clusters"
PRESETS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


# ---------------------------------------------------------------------------------------------- the fit

class HeadOnly:
    """A node provider holding the running head node only (what the scheduler asks of a provider)."""

    def __init__(self, head_type: str):
        self.head_type = head_type

    def node_tags(self, node_id):
        from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

        return {TAG_RAY_NODE_KIND: NODE_KIND_HEAD, TAG_RAY_USER_NODE_TYPE: self.head_type}

    def internal_ip(self, node_id):
        return "10.0.0.1"


def load_cluster(name: str) -> dict:
    """A cluster file as the autoscaler sees it: launcher files as written (every node type declares its
    resources; Ray's GCP provider adds only TPUs), the KubeRay manifest through Ray's own translation."""
    doc = yaml.safe_load((CLUSTERS / name).read_text())
    if doc.get("kind") == "RayCluster":
        from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

        doc = copy.deepcopy(doc)
        doc["metadata"].setdefault("namespace", "default")  # set by the API server
        return _derive_autoscaling_config_from_ray_cr(doc)
    return doc


def place(cluster: dict, demands: Demands, rounds: int = 20) -> tuple[dict, list]:
    """(worker nodes launched per type, requests left unplaced) after the autoscaler's launch rounds."""
    from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
    from ray.autoscaler._private.resource_demand_scheduler import ResourceDemandScheduler
    from ray.core.generated.common_pb2 import Bundle, PlacementStrategy
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData

    types = copy.deepcopy(cluster["available_node_types"])
    for t in types.values():
        t.setdefault("min_workers", 0)
        t.setdefault("max_workers", 0)
    head = cluster["head_node_type"]
    sched = ResourceDemandScheduler(HeadOnly(head), types, cluster["max_workers"], head,
                                    cluster.get("upscaling_speed", 1.0))
    groups = []
    if demands.learner_group:
        strategy, bundles = demands.learner_group
        groups.append(PlacementGroupTableData(
            strategy=getattr(PlacementStrategy, strategy),
            bundles=[Bundle(unit_resources=b) for b in bundles]))
    head_res = {"10.0.0.1": dict(types[head]["resources"])}
    launched: dict = {}
    residual: list = []
    for _ in range(rounds):
        to_add, residual = sched.get_nodes_to_launch(
            nodes=["head"], launching_nodes=dict(launched), resource_demands=list(demands.actors),
            unused_resources_by_ip=head_res, pending_placement_groups=groups, max_resources_by_ip=head_res,
            ensure_min_cluster_size=[], node_availability_summary=NodeAvailabilitySummary({}))
        if not to_add:
            break
        for t, n in to_add.items():
            launched[t] = launched.get(t, 0) + n
    return launched, [dict(r) for r in residual]


MODEL_DIR: list = []


@pytest.fixture(scope="module", autouse=True)
def stand_in_model(tmp_path_factory):
    """A directory with a config.json for presets naming a model this machine lacks (a vLLM config checks
    the directory at load, as tests/cluster/test_config.py does)."""
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    MODEL_DIR[:] = [d]


def preset(name: str, *overrides: str):
    """A preset's Config (a benchmark preset's production part, without its ``sim:`` section)."""
    path = CONFIG_DIR / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text()) or {}
    model = (raw.get("model") or {}).get("path")
    extra = [f"model.path={MODEL_DIR[0]}"] if model and not (Path(model) / "config.json").is_file() else []
    if "sim" in raw:
        from sonar.bench.sim.config import load_bench_config

        return load_bench_config([path], extra + list(overrides))[0]
    return load_config([path], extra + list(overrides))


CLOUD = ["aws.yaml", "gcp.yaml", "kuberay-cluster.yaml"]
FILES = CLOUD + ["local-fake.yaml"]


def expected_fit(preset_name: str, file: str) -> bool:
    """Every preset fits every cloud file; local-fake (3 two-CPU nodes, no GPU) hosts the CPU presets only."""
    return file in CLOUD or total(role_demands(preset(preset_name)), "GPU") == 0


@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_placed_by_the_autoscaler_on_the_files_meant_for_it(name, file):
    cluster = load_cluster(file)
    demands = role_demands(preset(name))  # the pool at rollout.max_workers
    launched, residual = place(cluster, demands)
    types = cluster["available_node_types"]
    if not expected_fit(name, file):
        assert residual, f"{name} on {file}: expected not to fit, launched {launched}"
        return
    assert residual == [], f"{name} on {file}: unplaced {residual} after launching {launched}"
    assert launched, f"{name} on {file}: the head hosts no role, so something must be launched"
    assert sum(launched.values()) <= cluster["max_workers"]
    for t, n in launched.items():
        assert t != cluster["head_node_type"] and n <= types[t]["max_workers"], (t, n)
    # the launched nodes hold every GPU and CPU asked for (nothing on the head but what it declares)
    for res in ("GPU", "CPU"):
        have = sum(types[t]["resources"].get(res, 0) * n for t, n in launched.items())
        assert have + types[cluster["head_node_type"]]["resources"].get(res, 0) >= total(demands, res)


@pytest.mark.parametrize("file", CLOUD)
def test_the_gpu_preset_needs_two_four_gpu_nodes_and_the_head_runs_no_gpu_work(file):
    cluster = load_cluster(file)
    cfg = preset("gpu")
    assert total(role_demands(cfg), "GPU") == 5  # learner 1 + 4 rollout workers x 1
    head = cluster["available_node_types"][cluster["head_node_type"]]["resources"]
    assert head.get("GPU", 0) == 0 and head.get("CPU", 0) == 0
    launched, residual = place(cluster, role_demands(cfg))
    gpu_type = next(t for t, v in cluster["available_node_types"].items() if v["resources"].get("GPU"))
    assert residual == [] and launched == {gpu_type: 2}  # retrieval's 8 CPUs fit the GPU nodes' spare CPUs
    # with two learner ranks packed on one node (STRICT_PACK) it still takes two nodes: 2 + 4 GPUs
    launched, residual = place(cluster, role_demands(preset("gpu", "learner.num_ranks=2")))
    assert residual == [] and launched == {gpu_type: 2}


@pytest.mark.parametrize("file", CLOUD)
def test_pinned_retrieval_brings_up_the_cpu_node_type(file):
    cluster = load_cluster(file)
    cfg = preset("gpu", "cluster.role_resources.retrieval.retrieval_node=1")
    launched, residual = place(cluster, role_demands(cfg))
    cpu_type = next(t for t, v in cluster["available_node_types"].items() if "retrieval_node" in v["resources"])
    assert residual == [] and launched.get(cpu_type) == 1, launched


@pytest.mark.parametrize("file", CLOUD)
def test_an_elastic_pool_at_its_maximum_still_fits(file):
    cluster = load_cluster(file)
    cfg = preset("gpu", "rollout.min_workers=2", "rollout.max_workers=8", "rollout.num_workers=4")
    launched, residual = place(cluster, role_demands(cfg))  # 1 + 8 GPUs
    assert residual == [] and sum(launched.values()) == 3, launched
    too_big = preset("gpu", "rollout.max_workers=64", "rollout.min_workers=4")
    assert place(cluster, role_demands(too_big))[1], "64 GPUs must not fit a 16-GPU file"


OLD_GCP = """
max_workers: 8
head_node_type: head
available_node_types:
  head: {resources: {}, node_config: {machineType: n2-standard-8}}
  gpu_worker: {min_workers: 0, max_workers: 4, resources: {}, node_config: {machineType: a2-highgpu-1g}}
"""


def test_the_old_gcp_file_shape_cannot_host_the_gpu_preset():
    """The issue's counterexample: node types with ``resources: {}`` (Ray's GCP provider fills in TPUs only)
    make the autoscaler add nothing; declared, four one-GPU nodes still cannot host five GPUs."""
    demands = role_demands(preset("gpu"))
    old = yaml.safe_load(OLD_GCP)
    launched, residual = place(old, demands)
    assert launched == {} and residual
    old["available_node_types"]["gpu_worker"]["resources"] = {"CPU": 12, "GPU": 1}  # a2-highgpu-1g declared
    launched, residual = place(old, demands)
    assert launched == {"gpu_worker": 4} and any(r.get("GPU") for r in residual)


# --------------------------------------------------------------------------- what the roles ask for

def test_role_demands_are_what_the_roles_are_started_with(monkeypatch, tmp_path):
    from sonar.cluster.driver import learner_ranks, roles
    from sonar.retrieval import factory, server

    cfg = preset("gpu", "learner.num_ranks=2", "cluster.role_resources.learner.big=1")
    d = role_demands(cfg, workers=4)
    assert d.learner_group == ("STRICT_PACK", learner_ranks.learner_bundles(cfg, {"big": 1.0}))
    assert d.actors == [{"CPU": 4.0, "GPU": 1.0}] * 4 + [{"CPU": 4.0}] * 2
    # the retrieval replicas are started asking for retrieval.num_cpus_per_replica
    seen = {}
    monkeypatch.setattr(factory, "build_retriever", lambda *a, **k: None)
    monkeypatch.setattr(server, "start_retrieval_service",
                        lambda rcfg, make, **kw: seen.update(kw) or type("C", (), {"handles": []})())
    roles.start_retrieval(cfg, None, str(tmp_path / "corpus.jsonl"))
    assert seen["num_cpus"] == 4.0 == cfg.retrieval.num_cpus_per_replica
    assert load_config([], []).retrieval.num_cpus_per_replica == 1.0


# ------------------------------------------------------------------------------ launcher files' shape

@pytest.mark.parametrize("file", ["aws.yaml", "gcp.yaml"])
def test_gpu_extra_only_on_gpu_nodes_and_images_with_a_580_driver(file):
    doc = yaml.safe_load((CLUSTERS / file).read_text())
    assert not any("[gpu]" in c for c in doc["setup_commands"] + doc["head_setup_commands"] + doc["worker_setup_commands"])
    for name, t in doc["available_node_types"].items():
        if name == doc["head_node_type"]:
            continue
        extra = '".[gpu]"' if t["resources"].get("GPU") else '".[cpu]"'
        assert any(extra in c for c in t["worker_setup_commands"]), (name, t["worker_setup_commands"])
        if file == "aws.yaml":  # the DLAMI family whose releases carry driver >= 580
            assert "base-oss-nvidia-driver-gpu-ubuntu-22.04" in t["node_config"]["ImageId"]
        else:
            image = t["node_config"]["disks"][0]["initializeParams"]["sourceImage"]
            assert image.endswith("-nvidia-580") and "/family/" in image


# ------------------------------------------------------------------------------- KubeRay CRD fields

# From ray-project/kuberay, ray-operator/config/crd/bases/ray.io_rayclusters.yaml and ray.io_rayjobs.yaml
# (version v1; read at commit feeaf72f): each level's property names and required ones, for the levels
# these manifests use (not the whole CRD). An unknown key is a typo the API server would prune silently.
CLUSTER_SPEC = {"authOptions", "autoscalerOptions", "enableInTreeAutoscaling", "gcsFaultToleranceOptions",
                "headGroupSpec", "headServiceAnnotations", "historyServerOptions", "managedBy", "networkPolicy",
                "rayVersion", "suspend", "tlsOptions", "upgradeStrategy", "workerGroupSpecs"}
CLUSTER_SPEC_REQUIRED = {"headGroupSpec"}
HEAD = {"enableIngress", "headService", "ingressOptions", "labels", "rayStartParams", "resources",
        "serviceType", "template"}
HEAD_REQUIRED = {"template"}
WORKER = {"groupName", "idleTimeoutSeconds", "labels", "maxReplicas", "minReplicas", "numOfHosts", "priority",
          "rayStartParams", "replicas", "resources", "scaleStrategy", "suspend", "template"}
WORKER_REQUIRED = {"groupName", "maxReplicas", "minReplicas", "template"}
AUTOSCALER = {"args", "command", "env", "envFrom", "idleTimeoutSeconds", "image", "imagePullPolicy", "resources",
              "securityContext", "upscalingMode", "version", "volumeMounts"}
UPSCALING_MODES = {"Default", "Aggressive", "Conservative"}
JOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "clusterSelector", "deletionStrategy", "entrypoint",
            "entrypointNumCpus", "entrypointNumGpus", "entrypointResources", "jobId", "managedBy", "metadata",
            "preRunningDeadlineSeconds", "rayClusterSpec", "runtimeEnvYAML", "shutdownAfterJobFinishes",
            "submissionMode", "submitterConfig", "submitterPodTemplate", "suspend", "ttlSecondsAfterFinished"}
CONTAINER_REQUIRED = {"name"}  # PodSpec: containers required


def crd_errors(doc: dict) -> list[str]:
    """Where ``doc`` (a RayCluster or RayJob) leaves the CRD fields above; [] when it keeps to them."""
    errs: list[str] = []

    def keys(obj, path, allowed, required=frozenset()):
        if not isinstance(obj, dict):
            errs.append(f"{path}: not a mapping")
            return
        errs.extend(f"{path}.{k}: not a field of the CRD" for k in sorted(set(obj) - allowed))
        errs.extend(f"{path}.{k}: required" for k in sorted(set(required) - set(obj)))

    def str_map(obj, path):
        if not (isinstance(obj, dict) and all(isinstance(v, str) for v in obj.values())):
            errs.append(f"{path}: must map to strings")

    def template(t, path):
        containers = (t or {}).get("spec", {}).get("containers")
        if not containers:
            errs.append(f"{path}.spec.containers: required")
        for i, c in enumerate(containers or []):
            keys(c, f"{path}.spec.containers[{i}]", set(c), CONTAINER_REQUIRED)

    def cluster_spec(s, path):
        keys(s, path, CLUSTER_SPEC, CLUSTER_SPEC_REQUIRED)
        if "enableInTreeAutoscaling" in s and not isinstance(s["enableInTreeAutoscaling"], bool):
            errs.append(f"{path}.enableInTreeAutoscaling: boolean")
        if "autoscalerOptions" in s:
            keys(s["autoscalerOptions"], f"{path}.autoscalerOptions", AUTOSCALER)
            if s["autoscalerOptions"].get("upscalingMode", "Default") not in UPSCALING_MODES:
                errs.append(f"{path}.autoscalerOptions.upscalingMode: one of {sorted(UPSCALING_MODES)}")
        h = s.get("headGroupSpec", {})
        keys(h, f"{path}.headGroupSpec", HEAD, HEAD_REQUIRED)
        str_map(h.get("rayStartParams", {}), f"{path}.headGroupSpec.rayStartParams")
        template(h.get("template"), f"{path}.headGroupSpec.template")
        for i, w in enumerate(s.get("workerGroupSpecs", [])):
            p = f"{path}.workerGroupSpecs[{i}]"
            keys(w, p, WORKER, WORKER_REQUIRED)
            for k in ("replicas", "minReplicas", "maxReplicas"):
                if k in w and not (isinstance(w[k], int) and not isinstance(w[k], bool)):
                    errs.append(f"{p}.{k}: integer")
            if all(isinstance(w.get(k), int) for k in ("minReplicas", "maxReplicas", "replicas")) and \
                    not w["minReplicas"] <= w["replicas"] <= w["maxReplicas"]:
                errs.append(f"{p}: needs minReplicas <= replicas <= maxReplicas")
            str_map(w.get("rayStartParams", {}), f"{p}.rayStartParams")
            template(w.get("template"), f"{p}.template")

    if doc.get("apiVersion") != "ray.io/v1":
        errs.append("apiVersion: ray.io/v1")
    if doc.get("kind") == "RayCluster":
        cluster_spec(doc.get("spec", {}), "spec")
    elif doc.get("kind") == "RayJob":
        s = doc.get("spec", {})
        keys(s, "spec", JOB_SPEC)
        if not isinstance(s.get("entrypoint"), str):
            errs.append("spec.entrypoint: string")
        if "clusterSelector" in s:
            str_map(s["clusterSelector"], "spec.clusterSelector")
        if "rayClusterSpec" in s:
            cluster_spec(s["rayClusterSpec"], "spec.rayClusterSpec")
    else:
        errs.append("kind: RayCluster or RayJob")
    return errs


def test_kuberay_manifests_keep_to_the_crd_fields():
    cluster = yaml.safe_load((CLUSTERS / "kuberay-cluster.yaml").read_text())
    job = yaml.safe_load((CLUSTERS / "kuberay-job.yaml").read_text())
    assert crd_errors(cluster) == [] and crd_errors(job) == []
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    gpu = [w for w in spec["workerGroupSpecs"]
           if "nvidia.com/gpu" in w["template"]["spec"]["containers"][0]["resources"]["limits"]]
    assert gpu and all(w["maxReplicas"] > w["minReplicas"] for w in spec["workerGroupSpecs"])
    # the job runs sonar train on this cluster, with overrides the config accepts
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    argv = job["spec"]["entrypoint"].split()
    assert argv[:4] == ["sonar", "train", "--config", "gpu"]
    overrides = [a for a in argv[4:] if not a.startswith("model.path=")]  # a directory this machine lacks
    assert "model.path=/models/policy" in argv and preset("gpu", *overrides).retrieval.corpus == "/data/wiki18.jsonl"


def test_the_crd_check_can_fail():
    cluster = yaml.safe_load((CLUSTERS / "kuberay-cluster.yaml").read_text())
    bad = copy.deepcopy(cluster)
    bad["spec"]["workerGroupSpecs"][0]["maxReplica"] = bad["spec"]["workerGroupSpecs"][0].pop("maxReplicas")
    bad["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    bad["spec"]["autoscalerOptions"]["upscalingMode"] = "Fast"
    errs = crd_errors(bad)
    assert "spec.workerGroupSpecs[0].maxReplica: not a field of the CRD" in errs
    assert "spec.workerGroupSpecs[0].maxReplicas: required" in errs
    assert "spec.headGroupSpec.rayStartParams: must map to strings" in errs
    assert any("upscalingMode" in e for e in errs)
