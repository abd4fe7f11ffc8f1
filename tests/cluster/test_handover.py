"""The colocated hand-over (cluster/transport/handover.py) under the weight push: the same BroadcastGroup
calls (staged, streamed, several pushes, a segment that grows), every byte equal, nothing left in the
segment folder, and a peer that never comes raising within the group's timeout."""
import os
import threading

import pytest
import torch

from sonar.cluster.transport.handover import HandoverCollective, segment_dir
from sonar.cluster.transport.weights import BroadcastGroup, Checksum, TensorSpec, checksum, plan_buckets
from sonar.learner.worker import free_port


def _specs(tensors):
    return [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


def _run(ranks: dict, timeout_s: float = 60.0):
    """Run ``ranks[r]()`` on a thread per rank; every exception is re-raised (the first)."""
    errors, out = [], {}

    def one(r):
        try:
            out[r] = ranks[r]()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank is still running"
    if errors:
        raise errors[0]
    return out


def _segments(port: int) -> list[str]:
    return [f for f in os.listdir(segment_dir()) if f.startswith(f"sonar-{port}-")]


def test_pushes_through_shared_memory_deliver_every_tensor_and_leave_no_segment_behind():
    torch.manual_seed(0)
    first = {"embed.weight": torch.randn(50, 8), "layer.0.w": torch.randn(8, 8), "layer.0.b": torch.randn(8),
             "norm.bf16": torch.randn(16).to(torch.bfloat16)}
    second = {n: t * 2 + 1 for n, t in first.items()}
    buckets = plan_buckets(_specs(first), bucket_bytes=300)
    assert len(buckets) >= 3 and len({b.nbytes for b in buckets}) >= 2  # the segment has to grow
    port, n = free_port(), 3
    groups: dict = {}

    def rank(r):
        g = BroadcastGroup("127.0.0.1", port, r, n, "shm", prefix="h", timeout_s=30)
        groups[r] = g
        got = []
        for src in (first, second):
            if r == 0:
                g.send_weights(buckets, src)
            elif r == 1:  # the HF engines' receiver: a staging copy
                got.append({k: v.clone() for k, v in g.recv_weights(buckets).items()})
            else:  # the vLLM workers' receiver: loaded bucket by bucket, summed as it arrives
                named, sums = {}, Checksum()
                g.recv_streamed(buckets, lambda items: named.update({k: v.clone() for k, v in items}), sums)
                got.append((named, sums.value))
        return got

    out = _run({r: (lambda r=r: rank(r)) for r in range(n)})
    for i, src in enumerate((first, second)):
        staged = out[1][i]
        streamed, summed = out[2][i]
        for name, t in src.items():
            assert torch.equal(staged[name], t) and torch.equal(streamed[name], t)
            assert staged[name].dtype == t.dtype
        assert summed == pytest.approx(checksum(src.items()), rel=1e-12)
    assert groups[0].backend == "shm" and groups[0].device.type == "cpu"
    assert _segments(port) == []  # unlinked once every receiver had mapped it
    for g in groups.values():
        g.close()


def test_a_receiver_whose_learner_never_sends_raises_within_the_timeout():
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    peer = HandoverCollective(dist.PrefixStore("x", master), 1, 2, f"sonar-{port}-x")
    work = peer.broadcast(torch.zeros(4))
    with pytest.raises(TimeoutError, match="rank 1 of 2 waited for the learner's broadcast 0"):
        work.wait(timedelta(seconds=0.5))


def test_a_learner_whose_receiver_never_takes_the_broadcast_raises_and_cleans_up():
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    root = HandoverCollective(dist.PrefixStore("y", master), 0, 2, f"sonar-{port}-y")
    work = root.broadcast(torch.arange(8, dtype=torch.float32))
    assert len(_segments(port)) == 1  # written, waiting for the receiver
    with pytest.raises(TimeoutError, match="every receiver to take broadcast 0"):
        work.wait(timedelta(seconds=0.5))
    root.close()
    assert _segments(port) == []


def test_a_segment_on_another_machine_is_named():
    from sonar.cluster.transport.handover import _FileSegment

    with pytest.raises(FileNotFoundError, match="colocated needs each engine on its learner rank's node"):
        _FileSegment(os.path.join(segment_dir(), "sonar-no-such-segment"), 8, create=False)


def test_only_integer_sums_and_the_learner_as_root():
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    c = HandoverCollective(dist.PrefixStore("z", master), 0, 1, f"sonar-{port}-z")
    with pytest.raises(ValueError, match="integers only"):
        c.allreduce([torch.zeros(1)])
    with pytest.raises(ValueError, match="the learner .rank 0. is the only source"):
        c.broadcast(torch.zeros(1), root=1)
    t = torch.tensor([3], dtype=torch.int64)
    c.allreduce([t]).wait(timedelta(seconds=5))
    assert t.tolist() == [3]
    c.close()
