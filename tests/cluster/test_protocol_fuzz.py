"""The codec refuses anything malformed with ProtocolError, and only ProtocolError (issue 14: of 9,042
fuzzed messages, 463 raised TypeError/KeyError/ValueError).

A seeded loop mutates valid messages (bit flips, truncation, wrong types in every field, missing keys,
extra keys, broken array headers) and decodes each: it must either raise ProtocolError or return
trajectories that round-trip themselves. Valid messages of every shape round-trip exactly. A
hypothesis test puts arbitrary msgpack values in every field of a valid message.
"""
from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sonar.cluster.wire.protocol import (SCHEMA_VERSION, ProtocolError, SearchCall, Segment, SegmentKind, ToolCall,
                                         Trajectory, decode_group, decode_trajectory, encode_group,
                                         encode_trajectory)


def random_traj(rng: random.Random, i: int = 0) -> Trajectory:
    """A valid trajectory of random shape: 0-4 turns, empty segments, no searches, None fields."""
    nrng = np.random.default_rng(rng.randrange(2**32))
    segs = [Segment(SegmentKind.PROMPT, nrng.integers(0, 1000, rng.randint(0, 30)))]
    searches = []
    for turn in range(rng.randint(0, 4)):
        n = rng.randint(0, 20)
        segs.append(Segment(SegmentKind.MODEL, nrng.integers(0, 1000, n), nrng.normal(size=n) - 1,
                            version=rng.randint(0, 50)))
        if rng.random() < 0.6:
            segs.append(Segment(SegmentKind.RETRIEVAL, nrng.integers(0, 1000, rng.randint(0, 40))))
            qs = [f"q{turn}{k}" for k in range(rng.randint(0, 3))]
            searches.append(SearchCall(turn, qs, [[f"d{k}"] * rng.randint(0, 2) for k in range(len(qs))],
                                       rng.random() * 50, rng.choice([None, "timeout"]), rng.randint(0, 2)))
    tools = [ToolCall(rng.randint(0, 4), "visit", [f"d{k}" for k in range(rng.randint(0, 2))],
                      rng.choice([[], ["d1"]]), rng.random() * 9, rng.choice([None, "not_found"]), rng.randint(0, 40))
             for _ in range(rng.randint(0, 2))]
    return Trajectory(traj_id=f"t{i}", group_id="g", prompt_id=f"p{rng.randint(0, 9)}", actor_id=rng.randint(0, 7),
                      segments=segs, reward=rng.choice([0.0, 1.0, -0.5, 1]),
                      reward_parts=rng.choice([{}, {"em": 1.0, "format": 0}]), searches=searches,
                      finish_reason=rng.choice(["answered", "max_turns", "malformed"]), question="q?",
                      golds=rng.choice([[], ["x"], ["x", "y"]]), prediction=rng.choice([None, "x"]),
                      stage=rng.randint(0, 2), weight=rng.choice([1.0, 0.25]), tool_calls=tools,
                      meta=rng.choice([{}, {"level": "hard", "n": 3, "ok": True, "x": None}]))


def same(a: Trajectory, b: Trajectory) -> bool:
    # repr: NaN equals itself there (a NaN reward or latency is a valid value that must round-trip)
    if repr([getattr(a, f) for f in _SCALARS]) != repr([getattr(b, f) for f in _SCALARS]) \
            or len(a.segments) != len(b.segments):
        return False
    for x, y in zip(a.segments, b.segments):
        if x.kind != y.kind or x.version != y.version or x.token_ids.dtype != y.token_ids.dtype:
            return False
        if not np.array_equal(x.token_ids, y.token_ids):
            return False
        if (x.logprobs is None) != (y.logprobs is None) or (
                x.logprobs is not None and not np.array_equal(x.logprobs, y.logprobs, equal_nan=True)):
            return False
    return True


_SCALARS = ("traj_id", "group_id", "prompt_id", "actor_id", "reward", "reward_parts", "searches", "finish_reason",
            "question", "golds", "prediction", "stage", "weight")


def test_valid_messages_of_every_shape_round_trip():
    rng = random.Random(0)
    for k in range(300):
        group = [random_traj(rng, i) for i in range(rng.randint(0, 5))]
        back = decode_group(encode_group(group))
        assert len(back) == len(group) and all(same(a, b) for a, b in zip(group, back)), k
        if group:
            assert same(group[0], decode_trajectory(encode_trajectory(group[0])))


# ---------------------------------------------------------------- mutations

def _raw(data: bytes):
    """A message as plain msgpack values, arrays left as ExtType (so they can be broken too)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _ext_variants(rng: random.Random):
    """Arrays whose header or body is wrong in one way."""
    def ext(dtype, shape, body, n=None):
        header = _pack([dtype, shape]) if not isinstance(dtype, bytes) else dtype
        return msgpack.ExtType(1, (len(header) if n is None else n).to_bytes(4, "little") + header + body)

    return rng.choice([
        ext("<i4", [3], b"\0" * 11),  # body one byte short
        ext("<i4", [2, 2], b"\0" * 16),  # 2-d
        ext("|O", [1], b"\0" * 8),  # object dtype
        ext("<U4", [1], b"\0" * 16),  # string dtype
        ext("V8", [1], b"\0" * 8),
        ext("not a dtype", [1], b"\0" * 4),
        ext("(2,)i4", [1], b"\0" * 8),
        ext("<i4", [-1], b""),
        ext("<i4", [2**62, 2**62], b""),
        ext("<i4", "3", b"\0" * 12),
        ext("<i4", [1.5], b"\0" * 4),
        ext(b"\xc1", [1], b"", n=1),  # undecodable header
        ext("<i4", [1], b"\0" * 4, n=2**31),  # header length past the end
        msgpack.ExtType(1, b"\x01"),  # shorter than the length field
        msgpack.ExtType(7, b"\0" * 8),  # unknown ext type
        ext("<f8", [2], b"\0" * 16),  # a float64 where int32/float32 belong
        ext(">i4", [1], b"\0" * 4),
        ext("|f1", [1], b"\0"),  # matches the dtype pattern, but numpy has no 1-byte float
    ])


_WRONG = [None, True, 0, -1, 2**64 - 1, -(2**63), 1.5, float("nan"), "", "x", b"\x00", [], [1, "a"], {}, {"a": 1},
          {1: 2}, [[[]]], msgpack.ExtType(9, b"")]


def _paths(obj, path=()):
    """Every (container, key) in the message."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield obj, k
            yield from _paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield obj, i
            yield from _paths(v, path + (i,))


def _mutate(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    r = rng.random()
    if r < 0.25:
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return "bitflip", bytes(b)
    if r < 0.4:
        return "truncate", data[: rng.randrange(len(data))]
    if r < 0.45:
        return "garbage", bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    obj = _raw(data)
    container, key = rng.choice(list(_paths(obj)))
    r = rng.random()
    if r < 0.45:
        container[key] = rng.choice(_WRONG)
        how = f"wrong type at {key!r}"
    elif r < 0.6:
        container[key] = _ext_variants(rng)
        how = f"bad array at {key!r}"
    elif r < 0.8 and isinstance(container, dict):
        del container[key]
        how = f"missing key {key!r}"
    elif isinstance(container, dict):
        container[rng.choice(["extra", 1, b"k", "segments_", None])] = rng.choice(_WRONG)
        how = "extra key"
    else:
        if rng.random() < 0.5:
            del container[key]
        else:
            container.append(rng.choice(_WRONG))
        how = f"list length at {key!r}"
    return how, _pack(obj)


def _decode_or_refuse(decode, data: bytes, how: str) -> str:
    try:
        out = decode(data)
    except ProtocolError:
        return "refused"
    except Exception as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{how}: {type(e).__name__} escaped the codec: {e}")
    # accepted: then it is a well-formed message, and it round-trips itself
    trajs = out if isinstance(out, list) else [out]
    again = decode_group(encode_group(trajs))
    assert all(same(a, b) for a, b in zip(trajs, again)), how
    return "accepted"


def test_mutated_messages_raise_only_protocol_error():
    rng = random.Random(14)
    counts = {"refused": 0, "accepted": 0}
    for k in range(3000):
        group = [random_traj(rng, i) for i in range(rng.randint(1, 3))]
        if rng.random() < 0.5:
            how, data = _mutate(rng, encode_group(group))
            counts[_decode_or_refuse(decode_group, data, f"#{k} group {how}")] += 1
        else:
            how, data = _mutate(rng, encode_trajectory(group[0]))
            counts[_decode_or_refuse(decode_trajectory, data, f"#{k} traj {how}")] += 1
    # most mutations break the message; some (a float for a float, a bit in a logprob) leave it valid
    assert counts["refused"] > 2000 and counts["accepted"] > 50, counts


@pytest.mark.parametrize("variant", range(18))
def test_each_broken_array_is_refused(variant):
    class Fixed(random.Random):
        def choice(self, seq):
            return seq[variant]

    msg = _raw(encode_trajectory(random_traj(random.Random(1))))
    msg["p"]["segments"][0][1] = _ext_variants(Fixed())
    with pytest.raises(ProtocolError):
        decode_trajectory(_pack(msg))


@pytest.mark.parametrize("mutate, match", [
    (lambda m: m.pop("t"), "expected a 'traj'"),
    (lambda m: m.update(v=True), "schema version"),  # True == 1, but it is not the version
    (lambda m: m.update(extra=1), "unknown keys"),
    (lambda m: m["p"].pop("golds"), r"missing keys \['golds'\]"),
    (lambda m: m["p"].update(golds="x"), r"trajectory.golds: expected list\[str\]"),
    (lambda m: m["p"].update(actor_id=1.0), "trajectory.actor_id: expected int"),
    (lambda m: m["p"].update(reward="1"), "trajectory.reward: expected float"),
    (lambda m: m["p"]["segments"].append([1, m["p"]["segments"][0][1], None, 0]), "MODEL segment without logprobs"),
    (lambda m: m["p"]["segments"][0].__setitem__(0, 3), r"segments\[0\]: kind 3"),
    (lambda m: m["p"]["searches"].append({"turn": 0}), r"searches\[\d\]: missing keys"),
    (lambda m: m.update(p=[]), "trajectory: expected a map"),
])
def test_malformed_structure_is_named(mutate, match):
    rng = random.Random(3)
    t = random_traj(rng)
    t.searches.append(SearchCall(0, ["a"], [["d"]], 1.0))
    msg = _raw(encode_trajectory(t))
    mutate(msg)
    with pytest.raises(ProtocolError, match=match):
        decode_trajectory(_pack(msg))


def test_a_group_payload_that_is_not_a_list_is_refused():
    with pytest.raises(ProtocolError, match="group payload"):
        decode_group(_pack({"v": SCHEMA_VERSION, "t": "group", "p": {"a": 1}}))


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4) | st.integers(-(2**63), 2**64 - 1), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.data())
def test_any_value_in_any_field_raises_only_protocol_error(data):
    msg = _raw(encode_trajectory(random_traj(random.Random(5))))
    container, key = data.draw(st.sampled_from(list(_paths(msg))))
    container[key] = data.draw(_msgpack_values)
    _decode_or_refuse(decode_trajectory, _pack(msg), f"{key!r} <- {container[key]!r:.60}")
