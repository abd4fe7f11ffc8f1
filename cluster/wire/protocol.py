"""Typed wire messages and the msgpack codec.

A trajectory is a list of segments. Each segment is PROMPT, MODEL or RETRIEVAL and holds int32
token ids; a MODEL segment also holds the float32 logprobs sampled for those tokens and the policy
version that produced them. The loss mask follows from the segment kinds (MODEL -> 1, else 0), so it
is born with the tokens and never rebuilt from strings.

Arrays travel as raw bytes with dtype and shape (msgpack ext type 1), never as Python lists.
Every encoded message carries ``SCHEMA_VERSION``; decoding another version raises ``ProtocolError``.

Pure module: numpy + msgpack only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Sequence

import msgpack
import numpy as np

SCHEMA_VERSION = 1
_EXT_NDARRAY = 1


class ProtocolError(ValueError):
    """A message that cannot be decoded (wrong schema version, malformed payload)."""


class SegmentKind(IntEnum):
    PROMPT = 0
    MODEL = 1
    RETRIEVAL = 2


class FinishReason:
    ANSWERED = "answered"
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"
    MALFORMED = "malformed"
    RETRIEVAL_ERROR = "retrieval_error"
    ALL = (ANSWERED, MAX_TURNS, MAX_TOKENS, MALFORMED, RETRIEVAL_ERROR)


@dataclass
class Segment:
    kind: SegmentKind
    token_ids: np.ndarray
    """int32 [n]"""
    logprobs: np.ndarray | None = None
    """float32 [n] sampling logprobs (MODEL only), at the sampling temperature, from raw logits."""
    version: int = -1
    """Policy version that sampled this segment (MODEL only; -1 otherwise)."""

    def __post_init__(self) -> None:
        self.kind = SegmentKind(self.kind)
        self.token_ids = np.asarray(self.token_ids, dtype=np.int32).reshape(-1)
        if self.kind == SegmentKind.MODEL:
            if self.logprobs is None:
                raise ProtocolError("MODEL segment without logprobs")
            self.logprobs = np.asarray(self.logprobs, dtype=np.float32).reshape(-1)
            if self.logprobs.shape != self.token_ids.shape:
                raise ProtocolError(
                    f"MODEL segment: logprobs shape {self.logprobs.shape} != token_ids shape {self.token_ids.shape}")
        elif self.logprobs is not None:
            raise ProtocolError(f"{self.kind.name} segment must not carry logprobs")

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class SearchCall:
    """One search step: its queries, the doc ids injected per query, latency and error."""

    turn: int
    queries: list[str]
    doc_ids: list[list[str]]
    latency_ms: float
    error: str | None = None
    dropped_queries: int = 0
    """Queries beyond the per-step budget (not sent)."""
    cache_hits: int = 0


@dataclass
class Trajectory:
    traj_id: str
    group_id: str
    prompt_id: str
    actor_id: int
    segments: list[Segment]
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    searches: list[SearchCall] = field(default_factory=list)
    finish_reason: str = FinishReason.MALFORMED
    question: str = ""
    golds: list[str] = field(default_factory=list)
    prediction: str | None = None
    stage: int = 0
    weight: float = 1.0
    """Sample weight set by the staleness policy (downweight); 1 otherwise."""

    # Derived views: computed from segments, never stored.
    def token_ids(self) -> np.ndarray:
        return np.concatenate([s.token_ids for s in self.segments]).astype(np.int32)

    def loss_mask(self) -> np.ndarray:
        """1 on MODEL tokens (trained), 0 on PROMPT and RETRIEVAL tokens."""
        return np.concatenate(
            [np.full(len(s), 1 if s.kind == SegmentKind.MODEL else 0, dtype=np.int8) for s in self.segments])

    def behaviour_logprobs(self) -> np.ndarray:
        """Sampling logprobs aligned with token_ids (0 on untrained tokens)."""
        return np.concatenate(
            [s.logprobs if s.kind == SegmentKind.MODEL else np.zeros(len(s), np.float32) for s in self.segments])

    def versions(self) -> np.ndarray:
        """Policy version per token (-1 on untrained tokens)."""
        return np.concatenate([np.full(len(s), s.version, dtype=np.int64) for s in self.segments])

    def min_version(self) -> int:
        vs = [s.version for s in self.segments if s.kind == SegmentKind.MODEL]
        return min(vs) if vs else -1

    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def num_model_tokens(self) -> int:
        return sum(len(s) for s in self.segments if s.kind == SegmentKind.MODEL)


def group_min_version(group: Sequence[Trajectory]) -> int:
    """The oldest policy version that sampled a token of the group (what its policy lag is measured
    from); trajectories without a MODEL token (``min_version() == -1``) do not count, and a group with
    none at all gives -1 (lag 0: nothing to correct)."""
    vs = [v for v in (t.min_version() for t in group) if v >= 0]
    return min(vs) if vs else -1


# ---------------------------------------------------------------- codec

def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        header = msgpack.packb([arr.dtype.str, list(arr.shape)], use_bin_type=True)
        return msgpack.ExtType(_EXT_NDARRAY, len(header).to_bytes(4, "little") + header + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_NDARRAY:
        raise ProtocolError(f"unknown msgpack ext type {code}")
    n = int.from_bytes(data[:4], "little")
    dtype, shape = msgpack.unpackb(data[4:4 + n], raw=False)
    return np.frombuffer(data[4 + n:], dtype=np.dtype(dtype)).reshape(shape).copy()


def _traj_to_obj(t: Trajectory) -> dict:
    d = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name not in ("segments", "searches")}
    d["segments"] = [[int(s.kind), s.token_ids, s.logprobs, s.version] for s in t.segments]
    d["searches"] = [dataclasses.asdict(c) for c in t.searches]
    return d


def _traj_from_obj(d: dict) -> Trajectory:
    d = dict(d)
    d["segments"] = [Segment(SegmentKind(k), ids, lp, v) for k, ids, lp, v in d["segments"]]
    d["searches"] = [SearchCall(**c) for c in d["searches"]]
    return Trajectory(**d)


def encode_trajectory(t: Trajectory) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, "t": "traj", "p": _traj_to_obj(t)}, default=_default, use_bin_type=True)


def encode_group(trajs: list[Trajectory]) -> bytes:
    """A GRPO group travels as one message: the learner consumes whole groups."""
    return msgpack.packb({"v": SCHEMA_VERSION, "t": "group", "p": [_traj_to_obj(t) for t in trajs]},
                         default=_default, use_bin_type=True)


def _unpack(data: bytes, expect: str) -> Any:
    try:
        msg = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as e:
        raise ProtocolError(f"undecodable message: {e}") from None
    if not isinstance(msg, dict) or "v" not in msg:
        raise ProtocolError("message without schema version")
    if msg["v"] != SCHEMA_VERSION:
        raise ProtocolError(f"schema version {msg['v']} != supported {SCHEMA_VERSION}")
    if msg.get("t") != expect:
        raise ProtocolError(f"expected a {expect!r} message, got {msg.get('t')!r}")
    return msg["p"]


def decode_trajectory(data: bytes) -> Trajectory:
    return _traj_from_obj(_unpack(data, "traj"))


def decode_group(data: bytes) -> list[Trajectory]:
    return [_traj_from_obj(d) for d in _unpack(data, "group")]


@dataclass
class StepResult:
    """What the learner's ``rl_step`` returns to the driver (through Ray, pickled).

    ``metrics``: the step's numbers under the keys of ``metrics.py``, nothing else, so the driver
    logs them as they are. ``trained_prompts`` / ``dropped_prompts``: indices into the training
    questions of the groups this step trained on and of those the replay dropped as stale on the way
    (the driver appends both to ``trained_prompts.jsonl``, which a resume is checked against: no
    prompt trained twice, none skipped). ``waiting``: no group arrived within the timeout, no step
    was taken (the driver checks the workers and asks again); ``metrics`` then hold only the wait.
    """

    metrics: dict[str, float]
    trained_prompts: list[int] = field(default_factory=list)
    dropped_prompts: list[int] = field(default_factory=list)
    waiting: bool = False
