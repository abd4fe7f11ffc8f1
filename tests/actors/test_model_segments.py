"""A turn sampled under two weights versions becomes one MODEL segment per version (never a mixed one)."""
from __future__ import annotations

import numpy as np
import pytest

from sonar.actors.rollout import model_segments
from sonar.cluster.wire.protocol import SegmentKind, Trajectory, Segment


IDS = np.arange(10, 17, dtype=np.int32)          # 7 tokens
LPS = -np.linspace(0.1, 0.7, 7).astype(np.float32)


def test_one_version_is_one_segment():
    (seg,) = model_segments(IDS, LPS, 4)
    assert seg.kind == SegmentKind.MODEL and seg.version == 4
    assert np.array_equal(seg.token_ids, IDS) and np.array_equal(seg.logprobs, LPS)


def test_spans_split_the_turn_by_version_and_concatenate_back():
    segs = model_segments(IDS, LPS, 3, ((3, 0, 2), (4, 2, 5), (6, 5, 7)))
    assert [s.version for s in segs] == [3, 4, 6]
    assert [len(s) for s in segs] == [2, 3, 2]
    assert np.array_equal(np.concatenate([s.token_ids for s in segs]), IDS)
    assert np.array_equal(np.concatenate([s.logprobs for s in segs]), LPS)


def test_a_truncated_turn_clips_the_spans_and_drops_empty_pieces():
    ids, lps = IDS[:4], LPS[:4]       # the rollout cut the row at its cap after the engine returned 7
    segs = model_segments(ids, lps, 3, ((3, 0, 2), (4, 2, 5), (6, 5, 7)))
    assert [(s.version, len(s)) for s in segs] == [(3, 2), (4, 2)]


def test_the_trajectory_keeps_per_token_versions_and_reports_its_oldest():
    segs = model_segments(IDS, LPS, 3, ((3, 0, 2), (5, 2, 7)))
    traj = Trajectory(traj_id="t", group_id="g", prompt_id="p", actor_id=0,
                      segments=[Segment(SegmentKind.PROMPT, np.array([1, 2], np.int32)), *segs])
    assert traj.versions().tolist() == [-1, -1, 3, 3, 5, 5, 5, 5, 5]
    assert traj.min_version() == 3    # staleness is measured from the oldest weights that sampled


@pytest.mark.parametrize("spans", [((3, 1, 7),), ((3, 0, 2), (4, 3, 7)), ((3, 0, 2), (4, 2, 5))])
def test_spans_that_do_not_tile_the_turn_are_refused(spans):
    with pytest.raises(ValueError, match="version_spans"):
        model_segments(IDS, LPS, 3, spans)
