import threading

import pytest
import torch

from sonar.cluster.transport.weights import BroadcastGroup, TensorSpec, checksum, layout_digest, plan_buckets
from sonar.learner.worker import free_port


def specs_of(tensors):
    return [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


def test_buckets_respect_budget_order_and_dtype():
    specs = [TensorSpec("a", (10,), torch.float32), TensorSpec("b", (20,), torch.float32),
             TensorSpec("c", (5,), torch.int64), TensorSpec("d", (100,), torch.float32)]
    buckets = plan_buckets(specs, bucket_bytes=120)
    assert [[s.name for s in b.specs] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert all(len({s.dtype for s in b.specs}) == 1 for b in buckets)
    assert [s for b in buckets for s in b.specs] == specs


def test_layout_digest_detects_mismatch():
    a = [TensorSpec("w", (2, 3), torch.float32)]
    assert layout_digest(a) == layout_digest(list(a))
    assert layout_digest(a) != layout_digest([TensorSpec("w", (3, 2), torch.float32)])


def test_checksum_is_order_independent_and_name_sensitive():
    x, y = torch.randn(3), torch.randn(4)
    assert checksum([("x", x), ("y", y)]) == pytest.approx(checksum([("y", y), ("x", x)]))
    assert checksum([("x", x), ("y", y)]) != pytest.approx(checksum([("x", y), ("y", x)]))


def test_gloo_broadcast_delivers_every_tensor_to_every_rank():
    torch.manual_seed(0)
    src = {"embed.weight": torch.randn(50, 8), "layer.0.w": torch.randn(8, 8), "layer.0.b": torch.randn(8),
           "steps": torch.arange(6)}
    buckets = plan_buckets(specs_of(src), bucket_bytes=1024)
    assert len(buckets) >= 2  # several buckets are exercised
    port, n = free_port(), 3
    received: dict[int, dict] = {}
    errors: list[BaseException] = []

    def rank(r):
        try:
            g = BroadcastGroup("127.0.0.1", port, r, n, "gloo", prefix="t", timeout_s=30)
            if r == 0:
                g.send_weights(buckets, src)
            else:
                received[r] = {k: v.clone() for k, v in g.recv_weights(buckets).items()}
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors, errors
    for r in (1, 2):
        assert set(received[r]) == set(src)
        for k in src:
            assert torch.equal(received[r][k], src[k])
        assert checksum(received[r].items()) == pytest.approx(checksum(src.items()))


def test_flatten_bucket_is_the_inverse_of_unflatten_and_fills_the_given_buffer():
    from sonar.cluster.transport.weights import flatten_bucket, unflatten_bucket

    torch.manual_seed(1)
    src = {"a": torch.randn(3, 4), "b": torch.randn(5), "c": torch.randn(2, 2, 2)}
    (bucket,) = plan_buckets(specs_of(src))
    out = torch.full((bucket.numel,), float("nan"))
    flat = flatten_bucket(bucket, src, out)
    assert flat is out and bucket.numel == 12 + 5 + 8
    assert torch.equal(flat, torch.cat([src[s.name].reshape(-1) for s in bucket.specs]))  # spec order
    back = dict(unflatten_bucket(bucket, flat))
    assert all(torch.equal(back[k], v) for k, v in src.items())


# ------------------------------------------------------------ the formation's presence barrier
def _present(port: int, prefix: str, ranks) -> bool:
    """Whether ``ranks`` have marked themselves present at the store on ``port`` (a client of its own)."""
    import datetime

    import torch.distributed as dist

    from sonar.cluster.transport.weights import PRESENCE_SUFFIX

    client = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=30))
    return dist.PrefixStore(prefix + PRESENCE_SUFFIX, client).check([f"present/{r}" for r in ranks])


def _form_in_threads(port: int, ranks, world_size: int, timeout_s: float, store=None):
    """Ranks ``ranks`` of a group of ``world_size`` start forming it, each in a thread (rank 0 on ``store``,
    as the learner forms it on the store its endpoint opened, if given); returns (threads, errors by rank,
    groups by rank)."""
    errors, groups = {}, {}

    def rank(r):
        try:
            groups[r] = BroadcastGroup("127.0.0.1", port, r, world_size, "gloo", prefix="p", timeout_s=timeout_s,
                                       store=store if r == 0 else None)
        except BaseException as e:  # surfaced by the test
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in ranks]
    [t.start() for t in threads]
    return threads, errors, groups


def test_a_formation_called_off_while_a_rank_is_missing_ends_at_once_on_every_waiting_rank():
    """Rank 2 never comes (it died before joining): ranks 0 and 1 wait at the presence barrier until the
    driver calls the formation off, and then raise GroupAborted with its reason, long before the group's
    600 s timeout (which is what they waited out before the barrier existed); so does rank 3, which arrives
    after the call-off."""
    import time

    from sonar.cluster.transport.weights import GroupAborted, abort_formation, open_store
    from tests.waiting import wait_until

    store = open_store("127.0.0.1", 4, timeout_s=600)  # the learner's endpoint: open before any rank joins
    port = store.port
    threads, errors, groups = _form_in_threads(port, [0, 1], 4, timeout_s=600, store=store)
    wait_until(lambda: _present(port, "p", [0, 1]), 120, "ranks 0 and 1 at the barrier", poll_s=0.05)
    t0 = time.monotonic()
    assert abort_formation("127.0.0.1", port, "p", "rollout worker 2 died before the group formed")
    [t.join(120) for t in threads]
    assert not any(t.is_alive() for t in threads) and not groups
    for r in (0, 1):
        assert isinstance(errors[r], GroupAborted), errors
        assert f"at rank {r} of 4: rollout worker 2 died before the group formed" in str(errors[r])
    # rank 3, slow to start, dials the meeting point after the call-off: the store is still open (the
    # learner holds an abandoned formation's store until the next one opens), so it is told at once, where
    # a closed port would have it retry its connect for the whole 600 s
    late, errors_late, _ = _form_in_threads(port, [3], 4, timeout_s=600)
    late[0].join(120)
    assert not late[0].is_alive() and isinstance(errors_late.get(3), GroupAborted), errors_late
    assert time.monotonic() - t0 < 120  # not the 600 s timeout


def test_a_rank_that_never_arrives_is_named_when_the_barrier_times_out():
    import torch.distributed as dist

    from sonar.cluster.transport.weights import presence_barrier

    store = dist.HashStore()
    store.set("present/2", b"1")  # rank 2 arrived; 1 and 3 never do
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1, 3\] of 4 did not arrive within 0.2 s \(rank 0 waited"):
        presence_barrier(store, 0, 4, timeout_s=0.2)
    assert store.check(["present/0"])  # rank 0 marked itself before it waited


def test_the_barrier_returns_once_every_rank_is_present_and_a_call_off_with_no_store_reports_it():
    """The whole group forms (the barrier, then gloo's rendezvous) and pushes; calling off a formation
    whose store is gone (nobody listens on its port) reports False within its connect timeout."""
    from sonar.cluster.transport.weights import abort_formation

    port = free_port()
    threads, errors, groups = _form_in_threads(port, [0, 1, 2], 3, timeout_s=60)
    [t.join(120) for t in threads]
    assert not errors and sorted(groups) == [0, 1, 2]
    x = torch.arange(5, dtype=torch.float32)
    done = []

    def recv(r):
        y = torch.zeros(5)
        groups[r].broadcast(y, 0)
        done.append(torch.equal(y, x))

    ts = [threading.Thread(target=recv, args=(r,)) for r in (1, 2)]
    [t.start() for t in ts]
    groups[0].broadcast(x.clone(), 0)
    [t.join(60) for t in ts]
    assert done == [True, True]
    for g in groups.values():
        g.close()
    assert abort_formation("127.0.0.1", free_port(), "p", "too late", connect_timeout_s=1.0) is False


# ------------------------------------------------------------ a push called off
@pytest.mark.parametrize("stuck", [1, 2, 3])
def test_a_push_called_off_ends_every_rank_at_once_whichever_rank_stopped(stuck):
    """Four ranks push six buckets over gloo; rank ``stuck`` (each receiver position in turn) stops inside
    the push, in its loader for the first bucket, as a dying worker does. The ranks that need its part of
    the collective (rank 0's next send, the ranks after it in the broadcast) would wait the group's 600 s
    for it. The driver, which sees the death, calls the push off (``abort_formation`` on the group's
    store): every rank still waiting raises ``GroupAborted`` carrying the reason at its next look, the
    stopped rank too once it moves again, none waits out the timeout, and none is left inside the push."""
    import time

    from sonar.cluster.transport.weights import GroupAborted, abort_formation, open_store

    torch.manual_seed(2)
    src = {f"layer.{i}.w": torch.randn(256) for i in range(6)}  # 1 KiB each: one bucket each
    buckets = plan_buckets(specs_of(src), bucket_bytes=1024)
    assert len(buckets) == 6
    store = open_store("127.0.0.1", 4, timeout_s=600)
    threads, errors, groups = _form_in_threads(store.port, [0, 1, 2, 3], 4, timeout_s=600, store=store)
    [t.join(120) for t in threads]
    assert not errors and sorted(groups) == [0, 1, 2, 3], errors
    inside, release = threading.Event(), threading.Event()
    ended: dict[int, BaseException | None] = {}
    received: dict[int, dict] = {}

    def hold(named):  # the stopped rank's loader for bucket 0: it is inside the push and goes no further
        inside.set()
        release.wait(300)

    def rank(r):
        try:
            g = groups[r]
            if r == 0:
                g.send_weights(buckets, src)
            elif r == stuck:
                g.recv_streamed(buckets, hold)
            else:
                received[r] = {k: v.clone() for k, v in g.recv_weights(buckets).items()}
            ended[r] = None
        except BaseException as e:  # surfaced below
            ended[r] = e

    pushers = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(4)]
    [t.start() for t in pushers]
    assert inside.wait(120), "the stopped rank never entered the push"
    t0 = time.monotonic()
    assert abort_formation("127.0.0.1", store.port, "p", f"rollout worker {stuck - 1} died during the push")
    others = [t for r, t in enumerate(pushers) if r != stuck]
    [t.join(120) for t in others]
    assert not any(t.is_alive() for t in others), "a rank still waits in the called-off push"
    release.set()
    pushers[stuck].join(120)
    assert not pushers[stuck].is_alive()
    assert time.monotonic() - t0 < 120  # not the 600 s timeout
    # A rank whose part needs nothing from the stopped one may have finished (gloo's sends of 1 KiB sit in
    # socket buffers): it holds the whole push. Every other rank says the push was called off, and why.
    aborted = {r: e for r, e in ended.items() if e is not None}
    assert set(ended) == {0, 1, 2, 3} and aborted, ended
    for r, e in aborted.items():
        assert isinstance(e, GroupAborted), ended
        assert f"weight push called off at rank {r} of 4: rollout worker {stuck - 1} died during the push" in str(e)
    for r in set(ended) - set(aborted) - {0, stuck}:
        assert all(torch.equal(received[r][k], src[k]) for k in src)


def test_the_nccl_weight_group_is_built_to_abort_its_communicator_not_the_process(monkeypatch):
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is read by each ``ProcessGroupNCCL`` constructor: the weight group
    is built under 2 (abort the communicator, raise; torch's default 3 kills the learner when a rank of the
    weight group dies), and the process's own setting, which DeepSpeed's groups read, is put back. The
    constructor is a recorder here (this torch has no NCCL)."""
    import os

    import torch.distributed as dist

    from sonar.cluster.transport import weights

    seen = []

    class Recorder:
        class Options:
            pass

        def __init__(self, store, rank, size, opts):
            seen.append((os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), rank, size, opts._timeout.total_seconds()))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", Recorder, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    weights.nccl_backend(None, 1, 4, timeout_s=30)
    assert seen == [("2", 1, 4, 30 + weights.NCCL_WATCHDOG_MARGIN_S)]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    weights.nccl_backend(None, 2, 4, timeout_s=30)
    assert seen[-1][0] == "2" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


def test_a_called_off_group_refuses_every_later_push_naming_why():
    """After a call-off (``BroadcastGroup.abort``) the group is never used again: a later push raises
    ``GroupAborted`` at once, not an ``AttributeError`` on the dropped backend."""
    from sonar.cluster.transport.weights import GroupAborted

    src = {"w": torch.randn(8)}
    buckets = plan_buckets(specs_of(src))
    port = free_port()
    threads, errors, groups = _form_in_threads(port, [0, 1], 2, timeout_s=60)
    [t.join(120) for t in threads]
    assert not errors and sorted(groups) == [0, 1], errors
    groups[0].abort()
    groups[0].abort()  # twice is once
    with pytest.raises(GroupAborted, match=r"weight group at rank 0 of 2 was called off: a new group must be formed"):
        groups[0].send_weights(buckets, src)
