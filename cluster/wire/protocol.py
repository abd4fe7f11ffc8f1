"""Typed wire messages and the msgpack codec.

A trajectory is a list of segments. Each segment is PROMPT, MODEL or RETRIEVAL and holds int32
token ids; a MODEL segment also holds the float32 logprobs sampled for those tokens and the policy
version that produced them. The loss mask follows from the segment kinds (MODEL -> 1, else 0), so it
is born with the tokens and never rebuilt from strings.

Arrays travel as raw bytes with dtype and shape (msgpack ext type 1), never as Python lists.
Every encoded message carries ``SCHEMA_VERSION``; decoding another version raises ``ProtocolError``,
and so does anything else malformed: the decoder checks every key and type against the dataclasses'
annotations and every array header (dtype, shape, byte count) before building objects, so no
TypeError/KeyError/ValueError escapes it (tests/cluster/test_protocol_fuzz.py).

Pure module: numpy + msgpack only.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

SCHEMA_VERSION = 2
"""2: ``Trajectory.tool_calls`` and ``meta``; ``SearchCall.cache_hits`` (always 0) gone. Version 1
messages still decode (``_upgrade_v1``)."""
READABLE_VERSIONS = (1, 2)
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
        if type(self.kind) is not SegmentKind:  # an enum call costs more than the rest of this check
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


@dataclass
class ToolCall:
    """One call of a tool (``actors/tools.py``) that keeps no record of its own: what was asked and what came
    back. Its output is a RETRIEVAL segment (loss mask 0); search's record is ``SearchCall`` (the rewards and
    the papers' metrics read its queries and the documents per query)."""

    turn: int
    tool: str
    """The tool's name (``Tool.name``): visit, or a plug-in's."""
    args: list[str]
    """The arguments as parsed from the model's call."""
    refs: list[str] = field(default_factory=list)
    """What the call touched, e.g. the document ids a visit opened."""
    latency_ms: float = 0.0
    error: str | None = None
    """None, or why the call failed (the tool's own word: not_found, timeout, ...)."""
    output_tokens: int = 0
    """Tokens of the output segment appended (0 when none was: error without text, no room)."""


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
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Calls of the tools other than search (visit, plug-ins), in order (schema 2)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The example's metadata from its dataset record (small scalars), for reward plug-ins (schema 2)."""

    # Derived views: computed from segments, never stored.
    def token_ids(self) -> np.ndarray:
        return np.concatenate([s.token_ids for s in self.segments]).astype(np.int32)

    def loss_mask(self) -> np.ndarray:
        """1 on MODEL tokens (trained), 0 on PROMPT and RETRIEVAL tokens."""
        return np.concatenate(
            [np.full(len(s), 1 if s.kind == SegmentKind.MODEL else 0, dtype=np.int8) for s in self.segments])

    def response_mask(self) -> np.ndarray:
        """1 on every token after the prompt (MODEL and RETRIEVAL), 0 on PROMPT tokens."""
        return np.concatenate(
            [np.full(len(s), 0 if s.kind == SegmentKind.PROMPT else 1, dtype=np.int8) for s in self.segments])

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


_ARRAY_DTYPE = re.compile(r"^[<>|][iuf](1|2|4|8)$")
"""``dtype.str`` of an array on the wire: signed, unsigned or float, 1-8 bytes; never object, string or void."""
_MAX_NDIM = 8


def _ext_hook(code: int, data: bytes) -> Any:
    """An ndarray: 4-byte little-endian header length, msgpack [dtype.str, shape], raw bytes. Every
    part is checked (dtype, shape, byte count) before numpy sees it."""
    if code != _EXT_NDARRAY:
        raise ProtocolError(f"unknown msgpack ext type {code}")
    if len(data) < 4:
        raise ProtocolError(f"ndarray ext of {len(data)} bytes has no header length")
    n = int.from_bytes(data[:4], "little")
    if 4 + n > len(data):
        raise ProtocolError(f"ndarray header length {n} exceeds the ext's {len(data) - 4} bytes")
    try:
        header = msgpack.unpackb(data[4:4 + n], raw=False)
    except Exception as e:  # msgpack's errors have no common base
        raise ProtocolError(f"ndarray header undecodable ({type(e).__name__}: {e})") from None
    if not (isinstance(header, list) and len(header) == 2 and isinstance(header[0], str)
            and isinstance(header[1], list) and len(header[1]) <= _MAX_NDIM
            and all(type(d) is int and d >= 0 for d in header[1])):
        raise ProtocolError(f"ndarray header {header!r:.80} is not [dtype, shape]")
    dtype_str, shape = header
    if not _ARRAY_DTYPE.match(dtype_str):
        raise ProtocolError(f"ndarray dtype {dtype_str!r:.40} is not a plain numeric dtype")
    try:
        dtype = np.dtype(dtype_str)
    except TypeError:  # '|f1': no such float
        raise ProtocolError(f"ndarray dtype {dtype_str!r} is not a numpy dtype") from None
    if dtype.str != dtype_str:  # e.g. '<i3' parses to nothing numpy would have written
        raise ProtocolError(f"ndarray dtype {dtype_str!r:.40} is not one numpy writes")
    count = 1
    for d in shape:
        count *= d
    body = len(data) - 4 - n
    if count * dtype.itemsize != body:
        raise ProtocolError(f"ndarray {dtype_str} of shape {shape} needs {count * dtype.itemsize} bytes, got {body}")
    return np.frombuffer(data[4 + n:], dtype=dtype).reshape(shape).copy()


def _kind(tp: Any) -> tuple[Callable[[Any], bool], str]:
    """(predicate, description) of a field annotation, for the decoder's structure checks. msgpack
    gives back what the encoder wrote: lists for lists, dicts for dicts, int or float for a float field
    (a Python int stored there), ndarrays from the ext hook. An annotation this does not know fails at
    import, so a new wire field cannot go unchecked."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return (lambda v: True), "anything"
    if tp is type(None):
        return (lambda v: v is None), "None"
    if tp is bool:
        return (lambda v: isinstance(v, bool)), "bool"
    if tp is int:
        return (lambda v: type(v) is int), "int"
    if tp is float:
        return (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)), "float"
    if tp is str:
        return (lambda v: isinstance(v, str)), "str"
    if tp is np.ndarray:
        return (lambda v: isinstance(v, np.ndarray)), "ndarray"
    if origin in (typing.Union, types.UnionType):
        parts = [_kind(a) for a in args]
        return (lambda v: any(f(v) for f, _ in parts)), " | ".join(d for _, d in parts)
    if origin is list and len(args) == 1:
        f, d = _kind(args[0])
        return (lambda v: isinstance(v, list) and all(f(x) for x in v)), f"list[{d}]"
    if origin is dict and len(args) == 2:
        (fk, dk), (fv, dv) = _kind(args[0]), _kind(args[1])
        return (lambda v: isinstance(v, dict) and all(fk(k) and fv(x) for k, x in v.items())), f"dict[{dk}, {dv}]"
    raise TypeError(f"protocol: no decoder check for the annotation {tp!r}; add one to _kind")


def _fields(cls: type, skip: tuple[str, ...] = ()) -> dict[str, tuple[Callable[[Any], bool], str]]:
    hints = typing.get_type_hints(cls)
    return {f.name: _kind(hints[f.name]) for f in dataclasses.fields(cls) if f.name not in skip}


_TRAJ_FIELDS = _fields(Trajectory, skip=("segments", "searches", "tool_calls"))
_SEARCH_FIELDS = _fields(SearchCall)
_TOOL_FIELDS = _fields(ToolCall)
_TOOL_KEYS = frozenset(_TOOL_FIELDS)
_TRAJ_KEYS = frozenset(f.name for f in dataclasses.fields(Trajectory))
_KINDS = {int(k): k for k in SegmentKind}


def _check_keys(d: Any, expected: frozenset, where: str) -> None:
    if not isinstance(d, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(d).__name__}")
    if d.keys() != expected:
        missing, extra = sorted(expected - d.keys()), sorted(map(repr, d.keys() - expected))
        raise ProtocolError(f"{where}: missing keys {missing}, unknown keys {extra[:5]}")


def _check_values(d: dict, fields: dict, where: str) -> None:
    for name, (ok, desc) in fields.items():
        if not ok(d[name]):
            raise ProtocolError(f"{where}.{name}: expected {desc}, got {type(d[name]).__name__}")


def _segment_from_obj(s: Any, where: str) -> Segment:
    if not (isinstance(s, list) and len(s) == 4):
        raise ProtocolError(f"{where}: expected [kind, token_ids, logprobs, version], got {type(s).__name__}")
    kind, ids, lp, version = s
    if type(kind) is not int or kind not in _KINDS:
        raise ProtocolError(f"{where}: kind {kind!r:.40} is not one of {sorted(_KINDS)}")
    if not (isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1):
        raise ProtocolError(f"{where}: token_ids must be a 1-d int32 array")
    if lp is not None and not (isinstance(lp, np.ndarray) and lp.dtype == np.float32 and lp.ndim == 1):
        raise ProtocolError(f"{where}: logprobs must be None or a 1-d float32 array")
    if type(version) is not int:
        raise ProtocolError(f"{where}: version must be an int, got {type(version).__name__}")
    try:
        return Segment(_KINDS[kind], ids, lp, version)
    except ProtocolError as e:  # MODEL without logprobs, shapes that differ, logprobs on another kind
        raise ProtocolError(f"{where}: {e}") from None


def _traj_to_obj(t: Trajectory) -> dict:
    d = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)
         if f.name not in ("segments", "searches", "tool_calls")}
    d["segments"] = [[int(s.kind), s.token_ids, s.logprobs, s.version] for s in t.segments]
    d["searches"] = [dataclasses.asdict(c) for c in t.searches]
    d["tool_calls"] = [dataclasses.asdict(c) for c in t.tool_calls]
    return d


_V1_ADDED = ("tool_calls", "meta")


def _upgrade_v1(d: Any, where: str) -> Any:
    """A schema-1 trajectory as schema 2: no tool calls, no metadata, searches without ``cache_hits``."""
    _check_keys(d, _TRAJ_KEYS - set(_V1_ADDED), where)
    d = dict(d, tool_calls=[], meta={})
    if isinstance(d["searches"], list):
        d["searches"] = [{k: v for k, v in c.items() if k != "cache_hits"} if isinstance(c, dict) else c
                         for c in d["searches"]]
    return d


def _traj_from_obj(d: Any, where: str = "trajectory", version: int = SCHEMA_VERSION) -> Trajectory:
    """A decoded payload -> Trajectory, every key and type checked first: anything malformed is a
    ProtocolError naming where it is, never a TypeError or KeyError from the constructors."""
    if version == 1:
        d = _upgrade_v1(d, where)
    _check_keys(d, _TRAJ_KEYS, where)
    _check_values(d, _TRAJ_FIELDS, where)
    d = dict(d)
    if not isinstance(d["segments"], list):
        raise ProtocolError(f"{where}.segments: expected a list, got {type(d['segments']).__name__}")
    d["segments"] = [_segment_from_obj(s, f"{where}.segments[{i}]") for i, s in enumerate(d["segments"])]
    d["searches"] = _records_from_obj(d["searches"], SearchCall, _SEARCH_KEYS, _SEARCH_FIELDS, f"{where}.searches")
    d["tool_calls"] = _records_from_obj(d["tool_calls"], ToolCall, _TOOL_KEYS, _TOOL_FIELDS, f"{where}.tool_calls")
    return Trajectory(**d)


def _records_from_obj(items: Any, cls: type, keys: frozenset, fields: dict, where: str) -> list:
    """A list of ``cls`` records (``SearchCall``, ``ToolCall``), each map's keys and types checked first."""
    if not isinstance(items, list):
        raise ProtocolError(f"{where}: expected a list, got {type(items).__name__}")
    out = []
    for i, c in enumerate(items):
        _check_keys(c, keys, f"{where}[{i}]")
        _check_values(c, fields, f"{where}[{i}]")
        out.append(cls(**c))
    return out


_SEARCH_KEYS = frozenset(_SEARCH_FIELDS)


def encode_trajectory(t: Trajectory) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, "t": "traj", "p": _traj_to_obj(t)}, default=_default, use_bin_type=True)


def encode_group(trajs: list[Trajectory]) -> bytes:
    """A GRPO group travels as one message: the learner consumes whole groups."""
    return msgpack.packb({"v": SCHEMA_VERSION, "t": "group", "p": [_traj_to_obj(t) for t in trajs]},
                         default=_default, use_bin_type=True)


def _unpack(data: bytes, expect: str) -> tuple[int, Any]:
    try:
        msg = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack's errors (ExtraData, StackError, FormatError, TypeError...) share no base
        raise ProtocolError(f"undecodable message ({type(e).__name__}: {e})") from None
    if not isinstance(msg, dict) or "v" not in msg:
        raise ProtocolError("message without schema version")
    if type(msg["v"]) is not int or msg["v"] not in READABLE_VERSIONS:
        raise ProtocolError(f"schema version {msg['v']!r:.40} is not one this code reads {list(READABLE_VERSIONS)}")
    if not isinstance(msg.get("t"), str) or msg["t"] != expect:  # an array there must not compare elementwise
        raise ProtocolError(f"expected a {expect!r} message, got {msg.get('t')!r:.40}")
    _check_keys(msg, _ENVELOPE, "message")
    return msg["v"], msg["p"]


_ENVELOPE = frozenset(("v", "t", "p"))


def decode_trajectory(data: bytes) -> Trajectory:
    """Raises ProtocolError for anything but a well-formed trajectory message of this schema version."""
    version, payload = _unpack(data, "traj")
    return _traj_from_obj(payload, version=version)


def decode_group(data: bytes) -> list[Trajectory]:
    """Raises ProtocolError for anything but a well-formed group message of this schema version."""
    version, payload = _unpack(data, "group")
    if not isinstance(payload, list):
        raise ProtocolError(f"group payload: expected a list of trajectories, got {type(payload).__name__}")
    return [_traj_from_obj(d, f"group[{i}]", version) for i, d in enumerate(payload)]


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
