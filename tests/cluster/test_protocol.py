import msgpack
import numpy as np
import pytest

from sonar.cluster.wire.protocol import (SCHEMA_VERSION, ProtocolError, SearchCall, Segment, SegmentKind, ToolCall, Trajectory,
                              decode_group, decode_trajectory, encode_group, encode_trajectory)


def make_traj(seed=0, n_prompt=5, n_model=(4, 3), n_ret=6):
    rng = np.random.default_rng(seed)
    segs = [Segment(SegmentKind.PROMPT, rng.integers(0, 500, n_prompt))]
    for i, n in enumerate(n_model):
        segs.append(Segment(SegmentKind.MODEL, rng.integers(0, 500, n), rng.normal(size=n) - 2, version=3 + i))
        if i < len(n_model) - 1:
            segs.append(Segment(SegmentKind.RETRIEVAL, rng.integers(0, 500, n_ret)))
    return Trajectory(traj_id=f"t{seed}", group_id="g", prompt_id="p", actor_id=1, segments=segs, reward=0.5,
                      reward_parts={"em": 1.0, "format": -0.5},
                      searches=[SearchCall(0, ["a", "b"], [["d1"], ["d2", "d3"]], 3.5, None, 1)],
                          tool_calls=[ToolCall(1, "visit", ["d2"], ["d2"], 1.5, None, 12)], meta={"level": "hard", "n": 3},
                      finish_reason="answered", question="q?", golds=["x", "y"], prediction="x")


def assert_same(a: Trajectory, b: Trajectory):
    assert a.traj_id == b.traj_id and a.reward == b.reward and a.reward_parts == b.reward_parts
    assert a.searches == b.searches and a.golds == b.golds and a.prediction == b.prediction
    assert len(a.segments) == len(b.segments)
    for x, y in zip(a.segments, b.segments):
        assert x.kind == y.kind and x.version == y.version
        assert x.token_ids.dtype == np.int32 and np.array_equal(x.token_ids, y.token_ids)
        if x.logprobs is None:
            assert y.logprobs is None
        else:
            assert y.logprobs.dtype == np.float32 and np.array_equal(x.logprobs, y.logprobs)


def test_round_trip_trajectory_and_group():
    t = make_traj()
    assert_same(t, decode_trajectory(encode_trajectory(t)))
    g = [make_traj(s) for s in range(4)]
    for a, b in zip(g, decode_group(encode_group(g))):
        assert_same(a, b)


def test_arrays_travel_as_bytes_not_lists():
    t = make_traj(n_prompt=2000)
    data = encode_trajectory(t)
    # 2000 int32 ids as raw bytes cost 8 kB; as a msgpack list of ints they would cost ~6 kB more.
    assert len(data) < 2000 * 4 + 1500


def test_wrong_schema_version_rejected():
    msg = msgpack.unpackb(encode_trajectory(make_traj()), raw=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))
    msg["v"] = SCHEMA_VERSION + 1
    bad = msgpack.packb(msg, use_bin_type=True)
    with pytest.raises(ProtocolError, match="schema version"):
        decode_trajectory(bad)


def test_wrong_message_type_and_garbage_rejected():
    with pytest.raises(ProtocolError, match="expected a 'traj'"):
        decode_trajectory(encode_group([make_traj()]))
    with pytest.raises(ProtocolError):
        decode_trajectory(b"\xc1garbage")


def test_loss_mask_is_derived_from_segment_kinds():
    t = make_traj(n_prompt=5, n_model=(4, 3), n_ret=6)
    mask = t.loss_mask()
    assert mask.tolist() == [0] * 5 + [1] * 4 + [0] * 6 + [1] * 3
    assert t.num_tokens() == 18 and t.num_model_tokens() == 7 and t.min_version() == 3
    lp = t.behaviour_logprobs()
    assert np.all(lp[mask == 0] == 0) and np.all(lp[mask == 1] != 0)


def test_segment_invariants():
    with pytest.raises(ProtocolError, match="without logprobs"):
        Segment(SegmentKind.MODEL, [1, 2])
    with pytest.raises(ProtocolError, match="shape"):
        Segment(SegmentKind.MODEL, [1, 2], [0.1])
    with pytest.raises(ProtocolError, match="must not carry"):
        Segment(SegmentKind.RETRIEVAL, [1, 2], [0.1, 0.2])


def test_group_min_version_ignores_trajectories_without_model_tokens():
    from sonar.cluster.wire.protocol import group_min_version

    sampled = [make_traj(0, n_model=(4, 3)), make_traj(1, n_model=(2,))]  # versions {3, 4} and {3}
    unsampled = make_traj(2, n_model=())  # prompt only: min_version() == -1
    assert unsampled.min_version() == -1
    assert group_min_version(sampled) == 3
    assert group_min_version(sampled + [unsampled]) == 3  # -1 must not make a stale group look fresh
    assert group_min_version([unsampled]) == -1
