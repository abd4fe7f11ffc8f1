import threading

import pytest
import torch

from sonar.cluster.wire.weights import BroadcastGroup, TensorSpec, checksum, layout_digest, plan_buckets
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
    from sonar.cluster.wire.weights import flatten_bucket, unflatten_bucket

    torch.manual_seed(1)
    src = {"a": torch.randn(3, 4), "b": torch.randn(5), "c": torch.randn(2, 2, 2)}
    (bucket,) = plan_buckets(specs_of(src))
    out = torch.full((bucket.numel,), float("nan"))
    flat = flatten_bucket(bucket, src, out)
    assert flat is out and bucket.numel == 12 + 5 + 8
    assert torch.equal(flat, torch.cat([src[s.name].reshape(-1) for s in bucket.specs]))  # spec order
    back = dict(unflatten_bucket(bucket, flat))
    assert all(torch.equal(back[k], v) for k, v in src.items())
