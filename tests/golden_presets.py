"""What each paper preset renders and rewards on fixed inputs: prompts, documents blocks, the invalid-action
message and the stage rewards of fixed trajectories, with GPT-2's BPE (tags as plain text, as a stock
tokenizer keeps them).

``compute()`` is the record ``tests/actors/test_presets_golden.py`` compares against
``tests/fixtures/golden/presets.json``, which was written by this module on the commit before tools and
plug-ins existed (48811cc): the papers' protocols must keep their exact text (``python -m
tests.golden_presets > tests/fixtures/golden/presets.json`` rewrites it, only for an intended change).
It uses only interfaces both commits have."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

PRESETS = ("r1_searcher", "search_r1", "rag_r1", "r1_searcher_tiny", "search_r1_tiny", "rag_r1_tiny", "tiny")
QUESTION = "who directed the film that won the award in 1994 ?"
DOCS = [[("The Film", "the film won the award in 1994 . it was directed by ann lee .")],
        [("Ann Lee", "ann lee is a director \" born in taiwan <answer> x </answer>")]]


def compute() -> dict:
    from sonar.actors.prompts import get_protocol, render_documents, render_invalid, render_prompt
    from sonar.actors.rewards import make_reward_fn
    from sonar.cluster.wire.config import load_config
    from sonar.cluster.wire.protocol import FinishReason, SearchCall, Segment, SegmentKind, Trajectory
    from tests.actors.test_real_tokenizer import gpt2_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tok = gpt2_tokenizer(Path(tmp), chat=True)  # lossless BPE, the tags as text: what a real model's run renders
    out = {}
    for name in PRESETS:
        cfg = load_config([name], notes=[])
        p = cfg.protocol
        tags = get_protocol(p.name)
        prompt = render_prompt(tags, QUESTION, tok, p.template, p.prompt, p.rules)
        queries = ["film award 1994", "ann lee"][: len(DOCS)]
        docs = render_documents(tags, DOCS, tok, p.max_doc_tokens, queries=queries, style=p.prompt, rules=p.rules)
        none = render_documents(tags, [[]], tok, p.max_doc_tokens, queries=queries[:1], style=p.prompt, rules=p.rules)
        failed = render_documents(tags, [[]], tok, p.max_doc_tokens, error="timeout", queries=queries[:1],
                                  style=p.prompt, rules=p.rules)
        rec = {"prompt": tok.decode(list(prompt), skip_special_tokens=False),
               "documents": tok.decode(list(docs), skip_special_tokens=False),
               "no_documents": tok.decode(list(none), skip_special_tokens=False),
               "failed": tok.decode(list(failed), skip_special_tokens=False),
               "invalid": tok.decode(list(render_invalid(tags, tok, p.prompt)), skip_special_tokens=False),
               "rewards": {}}
        turns = {
            "right": (f"{tags.think_open} find {tags.think_close} {tags.query_open} ann lee {tags.query_close}",
                      f"{tags.answer_open} ann lee {tags.answer_close}", FinishReason.ANSWERED, "ann lee"),
            "wrong": (f"{tags.query_open} film {tags.query_close}", f"{tags.answer_open} taiwan {tags.answer_close}",
                      FinishReason.ANSWERED, "taiwan"),
            "broken": (f"{tags.query_open} film {tags.query_close}", "lee", FinishReason.MALFORMED, None),
        }
        for i, st in enumerate(cfg.stages):
            if st.kind != "rl":
                continue
            fn = make_reward_fn(st.reward, tok, tags)
            for label, (first, last, finish, pred) in turns.items():
                ids = [list(tok.encode(t, add_special_tokens=False)) for t in (first, last)]
                segs = [Segment(SegmentKind.PROMPT, np.asarray(prompt, np.int32)),
                        Segment(SegmentKind.MODEL, np.asarray(ids[0], np.int32), np.zeros(len(ids[0]), np.float32), 0),
                        Segment(SegmentKind.RETRIEVAL, np.asarray(docs, np.int32)),
                        Segment(SegmentKind.MODEL, np.asarray(ids[1], np.int32), np.zeros(len(ids[1]), np.float32), 0)]
                t = Trajectory(f"t-{label}", "g", "p", 0, segs, finish_reason=finish, question=QUESTION,
                               golds=["Ann Lee"], prediction=pred,
                               searches=[SearchCall(0, ["film"], [["d1"]], 1.0)])
                rb = fn(t)
                rec["rewards"][f"stage{i}/{label}"] = [round(float(rb.total), 9),
                                                       {k: round(float(v), 9) for k, v in sorted(rb.parts.items())}]
        out[name] = rec
    return out


if __name__ == "__main__":
    json.dump(compute(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
