"""The weight transport: how the learner's weights reach the rollout workers, as the driver drives it.

The driver's rollout pool (``cluster/driver/rollout_pool.py``) is the only user. It forms the
transport's group (every worker and the learner join at once: membership is fixed at formation) and
pushes through it; it knows nothing else of how the bytes move. ``WeightTransport`` is what the pool
calls, and nothing more: each method makes one actor call and returns its Ray ObjectRef without
waiting (the pool waits, with its deadlines, and the calls that address a worker take the worker's
handle so that the pool makes them through its one fault path, ``RolloutPool.call``).

The sequence, as the pool runs it:

    ranks(w) for every worker          -> int each: ranks it takes (consecutive, from 1; the learner is 0)
    open(world_size)                   -> (host, port): the learner opens the meeting point
    join_source(ep); join(w, ep, rank) -> layout digest each, all at once; every digest must be equal
    send(); receive(w, version)        -> the push, all at once (only the version crosses Ray)
    abort(ep, reason)                  -> a rank died while the group formed: the others stop waiting

Every method makes one actor call and returns its ObjectRef, except ``abort``: the driver acts on the
meeting point itself (the learner's actor is busy in the rendezvous), best effort, and returns nothing.

``BroadcastTransport`` is the one implementation: the gloo/NCCL broadcast group of
``cluster/transport/weights.py`` (``BroadcastGroup``), whose actor halves are ``Learner.broadcast_endpoint``,
``setup_broadcast`` and ``broadcast`` (``learner/worker.py``) and ``RolloutWorker.broadcast_ranks``,
``setup_broadcast`` and ``receive_weights`` (``actors/worker.py``; a vLLM engine joins from its own
worker processes, ``actors/vllm_extension.py``). Another transport is one class of this shape, plus
its actor halves.

Pure: no Ray import (handles are duck-typed; ``.remote`` is called on them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Endpoint:
    """Where one formation of the group meets: ``host``/``port`` as the learner opened them,
    ``world_size`` ranks in all, and ``generation`` (1, 2, ...: each formation has its own, so a rank
    of an abandoned formation can never meet ranks of the next)."""

    host: str
    port: int
    world_size: int
    generation: int


class WeightTransport(Protocol):
    """The driver's half of a weight transport (module docstring). Every method returns an ObjectRef."""

    def ranks(self, worker) -> Any:
        """How many ranks ``worker`` takes in the group (int)."""

    def open(self, world_size: int) -> Any:
        """The learner opens the meeting point of a group of ``world_size`` ranks: ``(host, port)``."""

    def join_source(self, endpoint: Endpoint) -> Any:
        """The learner joins as rank 0; blocks until every rank has joined. Its layout digest (str)."""

    def join(self, worker, endpoint: Endpoint, rank: int) -> Any:
        """``worker`` joins as ``rank`` (the first of its ``ranks``); its layout digest (str)."""

    def send(self) -> Any:
        """The learner sends its current weights: ``{"seconds", "bytes", ...}`` (the transfer's figures)."""

    def receive(self, worker, version: int) -> Any:
        """``worker`` receives the weights of learner ``version`` (collective with ``send``)."""

    def abort(self, endpoint: Endpoint, reason: str) -> None:
        """Call off formation ``endpoint``: a rank died before it joined, so the ranks still waiting for it
        give up now instead of at the group's timeout. Called by the driver, at most once per formation;
        best effort (the formation may have failed already), returns nothing."""


class BroadcastTransport:
    """The gloo/NCCL broadcast group (``weights.BroadcastGroup``) as a ``WeightTransport``.

    ``learner``: rank 0's actor handle; ``backend``: "gloo" or "nccl" (``config.broadcast_backend``).
    The learner's tensor specs (names, shapes, dtypes: a few KB) are asked for at ``open`` and handed
    to every worker's ``join`` as an ObjectRef (Ray resolves it): the buckets take the sender's dtypes
    (a bf16 learner sends bf16 to engines holding float32, which cast on load)."""

    def __init__(self, learner, backend: str):
        self.learner, self.backend = learner, backend
        self._sender_specs = None

    @staticmethod
    def prefix(endpoint: Endpoint) -> str:
        """The store prefix of one formation (``BroadcastGroup``'s ``prefix``)."""
        return f"sonar-weights-{endpoint.generation}"

    def ranks(self, worker):
        return worker.broadcast_ranks.remote()

    def open(self, world_size: int):
        self._sender_specs = self.learner.param_specs.remote()
        return self.learner.broadcast_endpoint.remote(world_size)

    def join_source(self, endpoint: Endpoint):
        return self.learner.setup_broadcast.remote(endpoint.host, endpoint.port, endpoint.world_size, self.backend,
                                                   self.prefix(endpoint))

    def join(self, worker, endpoint: Endpoint, rank: int):
        return worker.setup_broadcast.remote(endpoint.host, endpoint.port, rank, endpoint.world_size, self.backend,
                                             self.prefix(endpoint), self._sender_specs)

    def send(self):
        return self.learner.broadcast.remote()

    def receive(self, worker, version: int):
        return worker.receive_weights.remote(version)

    def abort(self, endpoint: Endpoint, reason: str) -> None:
        from sonar.cluster.transport.weights import abort_formation  # torch: imported by the driver only when needed

        abort_formation(endpoint.host, endpoint.port, self.prefix(endpoint), reason)
