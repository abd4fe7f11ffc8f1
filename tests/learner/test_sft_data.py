"""The SFT data order: seeded epochs, exact continuation after a checkpoint, refusal of other data."""
import json

import numpy as np
import pytest

from sonar.cluster.wire.protocol import FinishReason, SearchCall, Segment, SegmentKind, Trajectory, encode_group
from sonar.learner.sft_data import SFTData, digest


def demo(i: int, latency_ms: float = 1.0) -> Trajectory:
    prompt = Segment(SegmentKind.PROMPT, np.asarray([1, 2, i + 10], np.int32))
    model = Segment(SegmentKind.MODEL, np.asarray([i + 100, 7], np.int32), np.zeros(2, np.float32), -1)
    return Trajectory(traj_id=f"demo-{i}", group_id=f"demo-{i}", prompt_id=f"q{i}", actor_id=-1,
                      segments=[prompt, model], reward=1.0, finish_reason=FinishReason.ANSWERED,
                      searches=[SearchCall(turn=0, queries=["q"], doc_ids=[["d"]], latency_ms=latency_ms)])


def groups(n: int = 7, latency_ms: float = 1.0) -> list[bytes]:
    return [encode_group([demo(i, latency_ms)]) for i in range(n)]


def ids(batch) -> list[str]:
    return [t.prompt_id for t in batch]


def test_epochs_are_seeded_permutations():
    a, b = SFTData(seed=3), SFTData(seed=3)
    assert a.set_demonstrations(groups()) == 7 and b.set_demonstrations(groups()) == 7
    first, second = ids(a.next(7)), ids(a.next(7))
    assert sorted(first) == sorted(second) == [f"q{i}" for i in range(7)]  # every demo once per epoch
    assert first != second  # a new permutation per epoch (7! orders: equal only by a 1/5040 chance)
    assert ids(b.next(14)) == first + second  # the same seed gives the same stream, however it is cut


def test_resume_continues_with_the_same_next_batches():
    """Train 3 batches, checkpoint (through JSON, as state.json does), then the killed run's next
    batches are exactly the resumed run's first batches, across an epoch boundary."""
    run = SFTData(seed=0)
    run.set_demonstrations(groups())
    for _ in range(3):
        run.next(3)  # 9 demos: the cursor is inside the second epoch
    state = json.loads(json.dumps(run.state_dict()))
    expected = [ids(run.next(3)) for _ in range(4)]

    resumed = SFTData(seed=0)
    resumed.load_state_dict(state)
    resumed.set_demonstrations(groups(latency_ms=99.0))  # rebuilt by the driver: other timings, same data
    assert [ids(resumed.next(3)) for _ in range(4)] == expected


def test_resume_with_other_demonstrations_is_refused():
    run = SFTData(seed=0)
    run.set_demonstrations(groups())
    run.next(2)
    state = json.loads(json.dumps(run.state_dict()))
    other = SFTData(seed=0)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="differ from the checkpoint"):
        other.set_demonstrations(groups(n=6))


def test_digest_covers_tokens_and_masks_not_timings():
    assert digest([demo(0, 1.0)]) == digest([demo(0, 50.0)])
    assert digest([demo(0)]) != digest([demo(1)])
    relabelled = demo(0)
    relabelled.segments[1] = Segment(SegmentKind.RETRIEVAL, relabelled.segments[1].token_ids)  # same ids, mask 0
    assert digest([demo(0)]) != digest([relabelled])


def test_no_demonstrations_is_an_error():
    with pytest.raises(ValueError, match="no demonstrations"):
        SFTData(seed=0).set_demonstrations([])
