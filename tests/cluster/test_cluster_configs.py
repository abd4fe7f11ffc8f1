"""The shipped Ray cluster-launcher configs are valid for the pinned Ray (its own schema)."""
import re
from pathlib import Path

import pytest
import yaml

ALL = sorted((Path(__file__).resolve().parents[2] / "cluster" / "clusters").glob("*.yaml"))
KUBERAY = [p for p in ALL if p.name.startswith("kuberay-")]
"""KubeRay custom resources (RayCluster, RayJob), not cluster-launcher configs: test_cluster_fit.py
checks them against the CRD's fields and Ray's own KubeRay autoscaling-config derivation."""
CLUSTERS = [p for p in ALL if p not in KUBERAY]


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
