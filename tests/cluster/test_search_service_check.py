"""A run whose search service is down stops before any learner or rollout worker starts, naming the
service's address (``retrieval/factory.py: probe_retriever``, called by ``roles.start_retrieval``)."""
import socket
import threading

import pytest

from sonar.cluster.wire.config import load_config
from sonar.retrieval.factory import SearchServiceDown, build_retriever, probe_retriever


def dead_url() -> str:
    """A loopback port nothing listens on (bound, then closed: connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/retrieve"


def test_a_dead_http_service_is_refused_naming_its_url(tmp_path):
    url = dead_url()
    cfg = load_config(["smoke"], ["retrieval.backend=http", f"retrieval.http.url={url}"]).retrieval
    r = build_retriever(cfg, None, str(tmp_path), resilient=False)
    with pytest.raises(SearchServiceDown, match=rf"retrieval.backend='http': the search service http:{url} failed"):
        probe_retriever(r, cfg)


def test_a_service_that_hangs_is_refused_after_the_timeout(tmp_path):
    release = threading.Event()

    class Hanging:
        name = "plugin:hangs@127.0.0.1:1"

        def batch_search(self, queries, k):
            release.wait()
            return [[] for _ in queries]

    cfg = load_config(["smoke"], ["retrieval.timeout_s=0.2"]).retrieval
    try:
        with pytest.raises(SearchServiceDown, match=r"plugin:hangs@127.0.0.1:1 did not answer a query within "
                                                    r"retrieval.timeout_s=0.2 s"):
            probe_retriever(Hanging(), cfg)
    finally:
        release.set()


def test_a_live_service_with_no_hits_passes(tmp_path):
    class Empty:
        name = "plugin:empty"

        def batch_search(self, queries, k):
            return [[] for _ in queries]

    probe_retriever(Empty(), load_config(["smoke"]).retrieval)


@pytest.mark.ray  # it calls start_roles (Ray itself is not started: init_ray is replaced)
def test_the_driver_refuses_before_the_policy_the_learner_or_a_worker(tmp_path, monkeypatch):
    from sonar.cluster.driver import roles

    started = []

    def must_not_start(name):
        def f(*a, **k):
            started.append(name)
            raise AssertionError(f"{name} started with the search service down")
        return f

    monkeypatch.setattr(roles, "init_ray", lambda cfg: False)  # no Ray needed to get this far
    for name in ("prepare_policy", "start_learner", "start_replicas"):
        monkeypatch.setattr(roles, name, must_not_start(name))
    monkeypatch.setattr(roles.RolloutPool, "start", must_not_start("RolloutPool.start"))
    url = dead_url()
    cfg = load_config(["smoke"], [f"run.root={tmp_path}", "retrieval.backend=http", f"retrieval.http.url={url}"])
    with pytest.raises(SearchServiceDown, match=url):
        roles.start_roles(cfg, None)
    assert started == []
