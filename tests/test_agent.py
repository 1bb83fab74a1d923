"""The multi-turn loop (stages/text/agent.py) with a scripted student in place of vLLM: tool failures become
error turns, turn and length limits end conversations, and the loss mask is 1 exactly on what the
student wrote. The loop through a real vLLM engine is tested in tests/test_tool_rollout.py."""

import json

import pytest

from gndpo.apps.demos.tool_task import CALL_CLOSE, END_OF_TURN, build_tokenizer, call_text, task_row
from gndpo.pipeline.settings.schema import DataConfig, RolloutConfig
from gndpo.stages.models.sampling import Generation, SamplingRequest
from gndpo.stages.text.agent import Conversation, ToolUse, run_conversations, turn_seed


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class ScriptedStudent:
    """Stands in for the sampler: each request gets the next turn of its conversation's script (by
    the request's seed, whose turn is read off ``turn_seed``). A turn that ends in a call stops there,
    as vLLM's stop string does; any other turn ends with the end-of-turn token."""

    def __init__(self, tok, scripts: dict[int, list[str]]):
        self.tok, self.scripts, self.requests = tok, scripts, []

    dtype_bits = 32

    def generate(self, prompts, params, on_finished=None, images=None):
        out = []
        for ids, p in zip(prompts, params):
            self.requests.append((list(ids), p))
            seed, turn = next((s, t) for s in self.scripts for t in range(8) if turn_seed(s, t) == p.seed)
            text = self.scripts[seed][turn]
            token_ids = self.tok(text, add_special_tokens=False)["input_ids"]
            called = text.endswith(CALL_CLOSE)
            if not called:
                token_ids = token_ids + [self.tok.convert_tokens_to_ids(END_OF_TURN)]
            finish = "stop"
            if len(token_ids) > p.max_tokens:
                token_ids, finish, called = token_ids[: p.max_tokens], "length", False
            logprobs = [-0.5] * len(token_ids)
            out.append(Generation(token_ids, logprobs, finish, CALL_CLOSE if called else None))
        return out


def sampling(seed, max_tokens, extra_stops):
    return SamplingRequest(seed, max_tokens, stop=tuple(extra_stops), keep_stop_text=True)


def converse(tok, scripts, tools=("calculator",), max_turns=4, budget=200, max_tokens=120, timeout_s=5.0, rows=None):
    student = ScriptedStudent(tok, scripts)
    rc = RolloutConfig(tools=list(tools), max_turns=max_turns, max_tool_response_tokens=budget, tool_timeout_s=timeout_s)
    tool_use = ToolUse.from_config(rc)
    rows = rows or [task_row(37, 41)] * len(scripts)
    convs = [Conversation(row, [1, 2, 3], seed) for row, seed in zip(rows, scripts)]
    run_conversations(student, tok, convs, DataConfig(), tool_use, max_tokens, sampling)
    return convs, student


def tool_turn_text(tok, c: Conversation, index: int) -> str:
    """The decoded text of the ``index``-th stretch of mask-0 tokens (a tool turn with its template)."""
    spans, start = [], None
    for i, m in enumerate(c.loss_mask + [1]):
        if m == 0 and start is None:
            start = i
        if m == 1 and start is not None:
            spans.append((start, i))
            start = None
    a, b = spans[index]
    return tok.decode(c.response_ids[a:b])


def test_a_good_call_then_an_answer(tok):
    (c,), student = converse(tok, {11: [call_text("37*41"), "1517"]})
    assert c.finish_reason == "stop" and c.num_turns == 2
    assert c.tool_calls == [{"turn": 0, "name": "calculator", "arguments": json.dumps({"expression": "37*41"}), "ok": True, "result": "1517"}]
    assert tool_turn_text(tok, c, 0) == "<|end|><|tool|>1517<|end|><|assistant|>"
    assert c.student_text(tok) == call_text("37*41") + "\n1517"
    # The second request continues from the whole conversation so far, with the turn's own seed.
    (first_ids, first), (second_ids, second) = student.requests
    assert second_ids == [1, 2, 3] + c.response_ids[: c.turn_spans[1][0]]
    assert first.seed == 11 and second.seed == turn_seed(11, 1) != 11
    assert first.stop == (CALL_CLOSE,)


def test_the_mask_is_one_exactly_on_student_tokens(tok):
    (c,), _ = converse(tok, {5: [call_text("12*3"), call_text("36+1"), "37"]})
    written = set()
    for a, b in c.turn_spans:
        written |= set(range(a, b))
    assert [int(i in written) for i in range(len(c.response_ids))] == c.loss_mask
    assert all(lp == 0.0 for lp, m in zip(c.sampler_logprobs, c.loss_mask) if m == 0)
    assert all(lp == -0.5 for lp, m in zip(c.sampler_logprobs, c.loss_mask) if m == 1)
    assert c.num_turns == 3 and [t["result"] for t in c.tool_calls] == ["36", "37"]


@pytest.mark.parametrize(
    "turn, tools, fragment",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+"}}</tool_call>', ("calculator",), "error: calculator: ValueError: cannot parse"),
        ("<tool_call>{name: calculator}</tool_call>", ("calculator",), "error: the tool call is not valid JSON"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', ("calculator",), "error: unknown tool 'search'; available: calculator"),
        ('<tool_call>{"name": "tests.custom_tools:broken", "arguments": {}}</tool_call>', ("tests.custom_tools:broken",),
         "error: tests.custom_tools:broken: RuntimeError: the service is down"),
        ('<tool_call>{"name": "tests.custom_tools:slow", "arguments": {}}</tool_call>', ("tests.custom_tools:slow",), "did not answer within 0.2 s"),
        ("the answer</tool_call>", ("calculator",), "error: </tool_call> without <tool_call>"),
    ],
    ids=["tool-raises", "bad-json", "unknown-tool", "user-tool-raises", "timeout", "close-without-open"],
)
def test_a_failing_call_becomes_an_error_turn_and_the_student_goes_on(tok, turn, tools, fragment):
    (c,), _ = converse(tok, {3: [turn, "42"]}, tools=tools, timeout_s=0.2)
    assert c.finish_reason == "stop" and c.num_turns == 2
    assert fragment in tool_turn_text(tok, c, 0)
    assert c.tool_calls[0]["ok"] is False and fragment in c.tool_calls[0]["result"]
    assert c.student_text(tok).endswith("\n42")


def test_a_call_in_the_last_allowed_turn_ends_the_conversation(tok):
    (c,), student = converse(tok, {9: [call_text("1*1")] * 5}, max_turns=3)
    assert c.finish_reason == "max_turns" and c.num_turns == 3 and len(student.requests) == 3
    assert [t["ok"] for t in c.tool_calls] == [True, True, False]
    assert c.tool_calls[-1]["result"] is None and c.tool_calls[-1]["name"] == "calculator"
    assert c.loss_mask[-1] == 1  # nothing follows the last call


def test_the_length_budget_caps_the_whole_conversation(tok):
    # This call is 7 tokens and its tool turn 5: the second tool turn is cut at the budget.
    (c,), student = converse(tok, {4: [call_text("2*3")] * 4}, budget=20)
    assert len(c.response_ids) == 20 and c.finish_reason == "length" and c.num_turns == 2
    # A student turn is also capped by what the budget leaves.
    (d,), student = converse(tok, {4: [call_text("2*3"), "1" * 50]}, budget=30)
    assert student.requests[1][1].max_tokens == 30 - 12
    assert len(d.response_ids) == 30 and d.finish_reason == "length"


def test_conversations_advance_together_and_stay_their_own(tok):
    scripts = {1: ["5"], 2: [call_text("6*7"), "42"], 3: [call_text("2*2"), call_text("4*4"), "16"]}
    convs, student = converse(tok, scripts, rows=[task_row(10, 10)] * 3)
    assert [c.num_turns for c in convs] == [1, 2, 3]
    # One generate call per turn, over the conversations still open: 3 + 2 + 1 requests.
    assert len(student.requests) == 6
    assert [c.student_text(tok).split("\n")[-1] for c in convs] == ["5", "42", "16"]


def test_without_tools_a_conversation_is_one_turn(tok):
    student = ScriptedStudent(tok, {7: [call_text("1*2")]})
    c = Conversation(task_row(1, 2), [1], 7)
    c.add_prefix([5, 6], ended=False)
    run_conversations(student, tok, [c], DataConfig(), None, 8, sampling)
    assert c.num_turns == 1 and c.finish_reason == "length" and c.tool_calls == []
    request = student.requests[0][1]
    assert (request.seed, request.max_tokens, request.stop) == (7, 6, ())  # the prefix counts in max_tokens
    assert c.loss_mask == [0, 0] + [1] * 6


def test_user_tools_are_called_by_their_path_or_a_name_given_to_them():
    tools = ToolUse.from_config(RolloutConfig(tools=["calculator", "tests.custom_tools:reverse", "flip = tests.custom_tools:reverse"])).tools
    assert sorted(tools) == ["calculator", "flip", "tests.custom_tools:reverse"]
    assert tools["flip"]({"text": "ab"}, {}) == "ba"


def test_a_rollout_config_with_unusable_tools_is_refused(tmp_path):
    from gndpo.errors import GndpoError
    from gndpo.pipeline.config.load import config_from_dict

    with pytest.raises(GndpoError, match="rollout.tools must be a list"):
        config_from_dict({"rollout": {"tools": [3]}})
    with pytest.raises(GndpoError, match="cannot be combined"):
        config_from_dict({"rollout": {"tools": ["calculator"], "guided_fraction": 0.5, "max_tokens": 8}})
    with pytest.raises(GndpoError, match="unknown tool"):
        ToolUse.from_config(RolloutConfig(tools=["nope"]))


def test_prompt_files_keep_their_tool_columns_as_json(tmp_path):
    from gndpo.pipeline.run.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "2*3", "answer": "6", "tool_calls": [{"name": "calculator", "arguments": {"expression": "2*3"}}],
         "lookup": {"a": 1}},
        {"prompt": "capital?", "answer": "Paris", "tool_calls": [{"name": "lookup", "arguments": {"key": "fr"}}],
         "lookup": {"fr": "Paris"}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompts(str(path)).to_dicts()
    # One struct type per column: keys missing from a row come back as nulls and are dropped.
    assert [json.loads(r["tool_calls"]) for r in got] == [r["tool_calls"] for r in rows]
    assert [json.loads(r["lookup"]) for r in got] == [r["lookup"] for r in rows]
    from gndpo.pipeline.tasks.tools import TOOLS, run_tool_call

    call = '<tool_call>{"name": "lookup", "arguments": {"key": "fr"}}</tool_call>'
    assert run_tool_call(call, TOOLS, got[1], 1.0).text == "Paris"


def test_the_calls_of_a_turn_run_at_once(tok):
    import time

    call = '<tool_call>{"name": "tests.custom_tools:nap", "arguments": {}}</tool_call>'
    t0 = time.monotonic()
    convs, _ = converse(tok, {s: [call, "ok"] for s in range(6)}, tools=("tests.custom_tools:nap",), timeout_s=5)
    assert time.monotonic() - t0 < 2.5  # six 0.5 s calls at once: 0.5 s and the turn's own work; one by one 3 s at least
    assert all(c.tool_calls[0]["result"] == "rested" for c in convs)
