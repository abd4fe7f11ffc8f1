"""The SFT stage's data: the demonstrations the driver sent, served in a seeded shuffled order.

The learner does not build demonstrations (the driver does, see ``cluster/driver/loop.py``); it gets
them as encoded groups (``cluster.wire.protocol.encode_group``, one demonstration per group) and serves
batches from them: a permutation per epoch drawn from one numpy generator seeded with ``run.seed``.

Exact resume: ``state_dict()`` (the permutation, the cursor in it, the generator state and a digest
of the demonstrations' tokens and loss masks) goes into the learner checkpoint. After
``load_state_dict``, the next ``set_demonstrations`` with the same demonstrations continues the
permutation at the cursor, so a resumed stage trains on the same next batches as the killed run
would have; with different demonstrations (another corpus, retriever or world) it raises instead of
silently training on other data.

Pure: numpy and the wire protocol only.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from sonar.cluster.wire.protocol import Trajectory, decode_group


def digest(demos: Sequence[Trajectory]) -> str:
    """What the training data is made of (token ids and loss masks, in order); timings excluded."""
    h = hashlib.sha256()
    for t in demos:
        ids = t.token_ids().astype(np.int64)
        h.update(len(ids).to_bytes(8, "little"))
        h.update(ids.tobytes())
        h.update(np.asarray(t.loss_mask(), np.int8).tobytes())
    return h.hexdigest()[:16]


class SFTData:
    """Demonstrations and their order (see the module docstring)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.demos: list[Trajectory] = []
        self.order = np.zeros(0, np.int64)
        self.cursor = 0
        self.digest = ""
        self._restored: dict | None = None

    def set_demonstrations(self, groups: Sequence[bytes]) -> int:
        """Decode the encoded groups; start a fresh permutation, or continue a restored one."""
        demos = [t for g in groups for t in decode_group(g)]
        if not demos:
            raise ValueError("an SFT stage got no demonstrations")
        d = digest(demos)
        restored, self._restored = self._restored, None
        self.demos, self.digest = demos, d
        if restored is not None and restored.get("order"):
            if restored.get("digest") not in (None, d) or len(restored["order"]) != len(demos):
                raise ValueError(
                    f"the demonstrations differ from the checkpoint's ({len(demos)} demonstrations, digest {d}; "
                    f"checkpoint: {len(restored['order'])}, digest {restored.get('digest')}): the resumed SFT stage "
                    "could not continue with the same batches (world, corpus, retrieval or protocol changed?)")
            self.order = np.asarray(restored["order"], np.int64)
            self.cursor = int(restored["cursor"])
        else:
            self.order = self.rng.permutation(len(demos))
            self.cursor = 0
        return len(demos)

    def next(self, n: int) -> list[Trajectory]:
        """The next ``n`` demonstrations; a new permutation starts when one is used up."""
        if not self.demos:
            raise RuntimeError("SFTData.next before set_demonstrations")
        out = []
        while len(out) < n:
            if self.cursor >= len(self.order):
                self.order = self.rng.permutation(len(self.demos))
                self.cursor = 0
            out.append(self.demos[self.order[self.cursor]])
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"order": [int(i) for i in self.order], "cursor": self.cursor, "digest": self.digest,
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        """Restore the generator now; the order and cursor apply to the next ``set_demonstrations``."""
        if state.get("rng") is not None:
            self.rng.bit_generator.state = state["rng"]
        self._restored = state
