"""Tools in the rollout loop (actors/tools.py), search one of them: the visit tool opens a document the
trajectory's search showed, or one found by its title, masked from the loss and recorded as a ToolCall;
budgets, errors and timeouts are data; a plug-in tool from a file outside the package runs the same way,
batched across trajectories as search is when it has ``call_batch``; search-only runs render exactly what
they rendered before tools existed."""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from sonar.actors.rewards import make_reward_fn, trajectory_reward
from sonar.actors.tools import TOOLS, ToolOutput, VisitTool, build_tools, first_tool_call
from sonar.cluster.wire.config import Config, ProtocolConfig, RewardConfig, resolve_paths, validate
from sonar.cluster.wire.protocol import FinishReason, SegmentKind, decode_group, encode_group
from sonar.retrieval.base import Hit
from tests.actors.test_rollout import ITEMS, TAGS, TOK, FakeRetriever, ScriptedEngine, em_reward, enc, run, word_tokenizer

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "my_plugins.py"
VTOK = word_tokenizer(("question : what is the capital of france germany paris berlin city country river "
                       "no results a b c d e , and answer . full text long story <visit> </visit> = 2 3 5 + "
                       "<calc> </calc> doc:capital").split())


def _cfg(**proto) -> Config:
    return dataclasses.replace(Config(), protocol=dataclasses.replace(Config().protocol, **proto))


def _run(script, tools, proto, retriever=None, tok=VTOK, **kw):
    from sonar.actors.rollout import rollout_groups

    return asyncio.run(rollout_groups(ITEMS[:1], engine=_Engine(script, tok), retriever=retriever or FakeRetriever(),
                                      tokenizer=tok, tags=TAGS, proto=proto, temperature=1.0, group_size=1, k=3,
                                      reward_fn=em_reward, tools=tools, **kw))


class _Engine(ScriptedEngine):
    def __init__(self, script, tok):
        super().__init__(script)
        self.tok = tok

    def generate_impl(self, prompts, params, caps):
        import numpy as np

        from sonar.actors.engine import Generation

        turn = len(self.calls)
        self.calls.append({"prompts": [list(map(int, p)) for p in prompts], "params": params})
        out = []
        for p in prompts:
            ids = self.tok.encode(self.script(list(map(int, p)), turn), add_special_tokens=False)[:params.max_new_tokens]
            for j, t in enumerate(ids):
                if t in params.stop_token_ids:
                    ids = ids[:j + 1]
                    break
            out.append(Generation(np.asarray(ids, np.int32), -0.01 * np.ones(len(ids), np.float32), "stop", 7, None))
        return out


def search_visit_answer(ctx, turn):
    return ["<search> capital of france </search>", "<visit> doc:capital of france </visit>",
            "<answer> paris </answer>"][min(turn, 2)]


def test_visit_opens_the_searched_document_in_full_masked_and_recorded():
    text = "paris is the capital of france " * 8  # longer than max_doc_tokens: the search cuts, the visit does not
    hit = Hit("doc:capital of france", "capital of france", text.strip(), 1.0)
    ret = FakeRetriever({"capital of france": [hit]})
    proto = ProtocolConfig(tools=["search", "visit"], max_doc_tokens=4, visit_max_tokens=30, max_total_tokens=512)
    tools = build_tools(_cfg(tools=["search", "visit"], max_doc_tokens=4, visit_max_tokens=30))
    groups, stats = _run(search_visit_answer, tools, proto, ret)
    t = groups[0][0]
    assert t.finish_reason == FinishReason.ANSWERED and t.prediction == "paris"
    assert len(t.searches) == 1 and len(ret.calls) == 1  # the visit was served from the search's hits
    (call,) = t.tool_calls
    assert (call.tool, call.args, call.refs, call.error) == ("visit", ["doc:capital of france"], ["doc:capital of france"], None)
    kinds = [s.kind for s in t.segments]
    assert kinds == [SegmentKind.PROMPT, SegmentKind.MODEL, SegmentKind.RETRIEVAL, SegmentKind.MODEL,
                     SegmentKind.RETRIEVAL, SegmentKind.MODEL]
    search_block, visit_block = len(t.segments[2]), len(t.segments[4])
    assert call.output_tokens == visit_block > search_block  # 30 tokens of the document against 4
    mask = t.loss_mask()
    start = sum(len(s) for s in t.segments[:4])
    assert not mask[start:start + visit_block].any()  # the visited document is never trained
    assert stats.tool_calls == {"search": 1, "visit": 1} and stats.tool_errors == {}
    # reward-neutral: the visit is no search for any reward
    rb = trajectory_reward(RewardConfig(name="r1_stage1"), t)
    assert rb.parts["num_searches"] == 1.0
    # the wire carries it
    (back,) = decode_group(encode_group([t]))
    assert back.tool_calls == t.tool_calls


def test_the_turn_stops_on_the_tools_closing_tag():
    def script(ctx, turn):
        return "<visit> capital of france </visit> <answer> paris </answer>" if turn == 0 else "<answer> paris </answer>"
    eng = _Engine(script, VTOK)
    from sonar.actors.rollout import rollout_groups

    proto = ProtocolConfig(tools=["search", "visit"])
    asyncio.run(rollout_groups(ITEMS[:1], engine=eng, retriever=FakeRetriever(), tokenizer=VTOK, tags=TAGS, proto=proto,
                               temperature=1.0, group_size=1, k=3, reward_fn=em_reward,
                               tools=build_tools(_cfg(tools=["search", "visit"]))))
    params = eng.calls[0]["params"]
    # this tokenizer spells the tag as a word (plain text), so the turn stops on its string
    assert "</visit>" in params.stop_strings
    assert len(eng.calls) == 2  # the visit's turn ended at </visit>, its answer came in the next turn


def test_visit_by_title_searches_and_unknown_documents_are_not_found():
    hit = Hit("d7", "berlin", "berlin is a city", 1.0)
    ret = FakeRetriever({"berlin": [hit], "river": []})
    proto = ProtocolConfig(tools=["search", "visit"])
    tools = build_tools(_cfg(tools=["search", "visit"]))
    groups, _ = _run(lambda c, t: ["<visit> berlin </visit>", "<visit> river </visit>", "<answer> paris </answer>"][t],
                     tools, proto, ret)
    t = groups[0][0]
    assert [(c.args, c.refs, c.error) for c in t.tool_calls] == [(["berlin"], ["d7"], None), (["river"], [], "not_found")]
    assert t.searches == []  # title lookups are the tool's, not search steps


def test_a_visit_past_its_budget_ends_the_trajectory_and_an_empty_one_is_invalid():
    proto = ProtocolConfig(tools=["search", "visit"], on_invalid="message")
    tools = build_tools(_cfg(tools=["search", "visit"], visit_max_calls=1))
    groups, _ = _run(lambda c, t: "<visit> berlin </visit>", tools, proto)
    t = groups[0][0]
    assert len(t.tool_calls) == 1 and t.finish_reason == FinishReason.MAX_TURNS
    groups, stats = _run(lambda c, t: "<visit> </visit>" if t == 0 else "<answer> paris </answer>", tools, proto)
    assert stats.invalid_messages == 1 and groups[0][0].tool_calls == []


class _Broken:
    name, open_tag, close_tag, max_calls, max_tokens = "boom", "<calc>", "</calc>", 3, 8

    def __init__(self, timeout_s=None, hang=False):
        self.timeout_s, self.hang = timeout_s, hang

    def parse(self, body):
        return [body.strip()]

    async def call(self, args, context):
        if self.hang:
            await asyncio.Event().wait()  # never set: only the tool's timeout ends it
        raise RuntimeError("tool bug")


@pytest.mark.parametrize("tool,error", [(_Broken(), "internal"), (_Broken(timeout_s=0.05, hang=True), "timeout")])
def test_a_failing_or_hanging_tool_is_data_not_a_crash(tool, error):
    proto = ProtocolConfig()
    groups, stats = _run(lambda c, t: "<calc> 2 + 3 </calc>" if t == 0 else "<answer> paris </answer>", [tool], proto)
    t = groups[0][0]
    assert t.finish_reason == FinishReason.ANSWERED and [c.error for c in t.tool_calls] == [error]
    assert stats.tool_errors == {"boom": 1}


def test_a_plugin_tool_from_a_file_outside_the_package_runs_in_the_loop():
    spec = f"{PLUGINS}:make_calculator"
    cfg = validate(resolve_paths(_cfg(tools=["search", spec], tool_options={"calc": {"max_calls": 1}})))
    assert str(PLUGINS) in cfg.plugins  # its source travels with the config
    search, calc = build_tools(cfg)  # search is a tool like the others, listed first here
    assert search.name == "search" and search.max_calls == cfg.protocol.max_turns
    assert calc.name == "calc" and calc.max_calls == 1
    groups, stats = _run(lambda c, t: "<calc> 2 + 3 </calc>" if t == 0 else "<answer> paris </answer>",
                         [calc], ProtocolConfig())
    t = groups[0][0]
    assert [(c.tool, c.args) for c in t.tool_calls] == [("calc", ["2", "3"])]
    assert "= 5" in VTOK.decode(list(t.segments[2].token_ids))
    assert stats.tool_calls == {"calc": 1}


def test_tool_options_for_a_tool_the_run_does_not_have_are_refused():
    with pytest.raises(ValueError, match=r"tool_options has settings for \['calc'\]"):
        build_tools(_cfg(tools=["search", "visit"], tool_options={"calc": {}}))


def test_first_tool_call_takes_whichever_action_opens_first():
    visit = VisitTool(Config())
    assert first_tool_call("<visit> a </visit>", [visit], ("<search>", "<answer>")) == (visit, " a ")
    assert first_tool_call("<answer> x </answer> <visit> a </visit>", [visit], ("<search>", "<answer>")) is None
    assert first_tool_call("<visit> a", [visit], ("<search>",)) is None  # incomplete: no call


def test_search_only_runs_render_what_they_did_before_tools():
    """The papers' presets list only search: the tool path adds no stop, no tag and no segment. The
    search_then_answer rollout of test_rollout gives the same tokens with and without an empty tool list."""
    from tests.actors.test_rollout import search_then_answer

    a, _ = run(engine=ScriptedEngine(search_then_answer), retriever=FakeRetriever(), group_size=1)
    b, _ = run(engine=ScriptedEngine(search_then_answer), retriever=FakeRetriever(), group_size=1, tools=[])
    assert [list(t.token_ids()) for g in a for t in g] == [list(t.token_ids()) for g in b for t in g]
    assert all(t.tool_calls == [] for g in a for t in g)
    assert TOOLS.names() == ("search", "visit")


def test_several_tools_in_one_trajectory_each_with_its_own_budget():
    spec = f"{PLUGINS}:make_calculator"
    cfg = validate(resolve_paths(_cfg(tools=["search", "visit", spec], visit_max_calls=1)))
    tools = build_tools(cfg)
    assert [t.name for t in tools] == ["search", "visit", "calc"]
    script = ["<search> capital of france </search>", "<visit> doc:capital of france </visit>",
              "<calc> 2 + 3 </calc>", "<calc> 5 + 5 </calc>", "<answer> paris </answer>"]
    groups, stats = _run(lambda c, t: script[t], tools, ProtocolConfig(tools=list(cfg.protocol.tools)))
    t = groups[0][0]
    assert [(c.tool, c.turn) for c in t.tool_calls] == [("visit", 1), ("calc", 2), ("calc", 3)]
    assert len(t.searches) == 1 and t.finish_reason == FinishReason.ANSWERED
    assert stats.tool_calls == {"search": 1, "visit": 1, "calc": 2}
    assert not t.loss_mask()[sum(len(s) for s in t.segments[:6]):sum(len(s) for s in t.segments[:7])].any()


class _Batched:
    """A plug-in tool with ``call_batch``: every call of a turn, across trajectories, in one coroutine."""
    name, open_tag, close_tag, max_calls, max_tokens = "calc", "<calc>", "</calc>", 3, 8

    def __init__(self, timeout_s=None, hang=False):
        self.timeout_s, self.hang, self.batches = timeout_s, hang, []

    def parse(self, body):
        return [body.strip()]

    async def call_batch(self, args, contexts):
        self.batches.append([a[0] for a in args])
        if self.hang:
            await asyncio.Event().wait()  # never set: only the tool's timeout ends the batch
        return [ToolOutput(text=str(eval(a[0], {}))) for a in args]  # "2 + 3" from the script below


def test_a_batched_plugin_tool_gets_every_call_of_a_turn_at_once_as_search_does():
    from sonar.actors.rollout import rollout_groups

    tool, ret = _Batched(), FakeRetriever()
    script = ["<search> capital of france </search>", "<calc> 2 + 3 </calc>", "<answer> paris </answer>"]
    groups, stats = asyncio.run(rollout_groups(
        ITEMS[:1], engine=_Engine(lambda c, t: script[t], VTOK), retriever=ret, tokenizer=VTOK, tags=TAGS,
        proto=ProtocolConfig(), temperature=1.0, group_size=4, k=3, reward_fn=em_reward, tools=[tool]))
    assert tool.batches == [["2 + 3"] * 4]  # four trajectories' calls, one coroutine
    assert len(ret.calls) == 1 and stats.retriever_calls == 1  # and search's four queries, one retriever call
    assert stats.tool_batches == {"search": 1, "calc": 1} and stats.tool_calls == {"search": 4, "calc": 4}
    for t in groups[0]:
        (c,) = t.tool_calls
        assert (c.tool, c.args, c.turn, c.error) == ("calc", ["2 + 3"], 1, None) and len(t.searches) == 1
        assert t.finish_reason == FinishReason.ANSWERED


def test_a_hanging_batch_times_out_as_a_whole_and_every_call_in_it_fails_as_data():
    tool = _Batched(timeout_s=0.05, hang=True)
    script = ["<calc> 2 + 3 </calc>", "<answer> paris </answer>"]
    groups, stats = _run(lambda c, t: script[t], [tool], ProtocolConfig())
    (c,) = groups[0][0].tool_calls
    assert c.error == "timeout" and c.latency_ms >= 40 and stats.tool_errors == {"calc": 1}
    assert groups[0][0].finish_reason == FinishReason.ANSWERED  # the trajectory went on


def test_search_is_a_tool_of_the_registry_with_the_protocols_budget():
    cfg = _cfg(max_turns=3, max_doc_tokens=7)
    (search,) = build_tools(cfg)
    assert isinstance(search, TOOLS.get("search", "protocol.tools[0]")) and search.open_tag is None
    assert (search.max_calls, search.max_tokens, search.timeout_s) == (3, 7, None)
    with pytest.raises(ValueError, match="search among them"):
        build_tools(_cfg(tools=["visit"]))
