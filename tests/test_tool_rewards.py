"""Tool-use rewards: ToolRL's correctness reward and the tool-call format reward, on hand-written
responses. Each expected correctness value is worked out in the test from ToolRL's formula:
score = match(gt names, predicted names) + for each gt call the best same-name predicted call's
(match(gt arg names, predicted arg names) + gt args whose value it repeats); max = 1 + sum(1 + gt arg
count); reward = 6 * score / max - 3."""

import json

import pytest

from gndpo.pipeline.tasks.rewards import REWARDS, score_response, tool_correctness, tool_format


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def gt(*calls: tuple[str, dict]) -> dict:
    return {"prompt_id": "p", "answer": "1517", "tool_calls": [{"name": n, "arguments": a} for n, a in calls]}


CALC = gt(("calculator", {"expression": "37 * 41"}))


# -- correctness ----------------------------------------------------------------------------------------
def test_exact_match_is_3():
    assert tool_correctness(call("calculator", expression="37 * 41") + "\n1517", CALC) == 3.0


def test_no_call_predicted_is_minus_3():
    # names: match(["calculator"], []) = 0; nothing to pair; max = 1 + (1 + 1)
    expected = 6 * 0 / (1 + (1 + 1)) - 3
    assert expected == -3.0
    assert tool_correctness("1517", CALC) == pytest.approx(expected)


def test_right_name_wrong_value():
    # names match (1); arg names match (1), the value differs (0); max = 1 + (1 + 1)
    expected = 6 * (1 + (1 + 0)) / (1 + (1 + 1)) - 3
    assert tool_correctness(call("calculator", expression="37*41") + "\n1517", CALC) == pytest.approx(expected)
    assert expected == 1.0


def test_right_name_extra_argument_key():
    # names 1; arg names ["expression"] vs ["expression", "precision"]: 1 / (1 + 2 - 1) = 0.5;
    # the one gt value is repeated (1); max = 1 + (1 + 1)
    expected = 6 * (1 + (0.5 + 1)) / (1 + (1 + 1)) - 3
    response = call("calculator", expression="37 * 41", precision=2) + "\n1517"
    assert tool_correctness(response, CALC) == pytest.approx(expected)
    assert expected == pytest.approx(2.0)


def test_two_gt_calls_one_predicted():
    row = gt(("lookup", {"key": "price"}), ("calculator", {"expression": "3 * 4"}))
    # names ["lookup", "calculator"] vs ["lookup"]: 1 / (2 + 1 - 1) = 0.5; lookup pairs (1 + 1);
    # calculator finds nothing; max = 1 + (1 + 1) + (1 + 1)
    expected = 6 * (0.5 + (1 + 1)) / (1 + (1 + 1) + (1 + 1)) - 3
    assert tool_correctness(call("lookup", key="price") + "\n12", row) == pytest.approx(expected)
    assert expected == pytest.approx(0.0)


def test_duplicate_predicted_calls():
    # names ["calculator"] vs ["calculator", "calculator"]: 1 / (1 + 2 - 1) = 0.5; the first copy pairs
    # (1 + 1), the second is left over; max = 1 + (1 + 1)
    expected = 6 * (0.5 + (1 + 1)) / (1 + (1 + 1)) - 3
    response = call("calculator", expression="37 * 41") + "\n" + call("calculator", expression="37 * 41") + "\n1517"
    assert tool_correctness(response, CALC) == pytest.approx(expected)
    assert expected == pytest.approx(2.0)


def test_wrong_tool_name():
    # names ["calculator"] vs ["lookup"]: 0 / (1 + 1 - 0) = 0; no same-name call; max = 1 + (1 + 1)
    expected = 6 * 0 / (1 + (1 + 1)) - 3
    assert tool_correctness(call("lookup", expression="37 * 41") + "\n1517", CALC) == pytest.approx(expected)


def test_no_gt_no_prediction_is_3():
    assert tool_correctness("1517", {"answer": "1517"}) == 3.0
    assert tool_correctness("1517", {"answer": "1517", "tool_calls": None}) == 3.0
    assert tool_correctness("1517", {"answer": "1517", "tool_calls": []}) == 3.0


def test_no_gt_but_a_prediction_is_minus_3():
    # names [] vs ["calculator"]: 0; max = 1
    expected = 6 * 0 / 1 - 3
    assert tool_correctness(call("calculator", expression="1 + 1") + "\n2", {"answer": "2"}) == expected


def test_unparseable_block_is_skipped():
    response = '<tool_call>{"name": "calculator", "arguments": </tool_call>\n' + call("calculator", expression="37 * 41") + "\n1517"
    assert tool_correctness(response, CALC) == 3.0
    # only an unparseable block: the same as no call at all
    assert tool_correctness("<tool_call>not json</tool_call>\n1517", CALC) == -3.0


def test_gt_as_json_string():
    row = {"answer": "1517", "tool_calls": json.dumps([{"name": "calculator", "arguments": {"expression": "37 * 41"}}])}
    assert tool_correctness(call("calculator", expression="37 * 41") + "\n1517", row) == 3.0
    expected = 6 * (1 + (1 + 0)) / (1 + (1 + 1)) - 3
    assert tool_correctness(call("calculator", expression="37*41") + "\n1517", row) == pytest.approx(expected)


def test_numbers_compare_by_value():
    row = gt(("add", {"a": 2, "b": 3}))
    assert tool_correctness(call("add", a=2.0, b=3) + "\n5", row) == 3.0


@pytest.mark.parametrize("bad", [
    "not json",
    '{"name": "calculator"}',
    [{"name": "calculator"}],
    [{"name": "", "arguments": {}}],
    [{"name": "calculator", "arguments": "37 * 41"}],
    ["calculator"],
    7,
])
def test_malformed_gt_raises_value_error(bad):
    row = {"answer": "1", "tool_calls": bad}
    for fn in (tool_correctness, tool_format):
        with pytest.raises(ValueError) as info:
            fn("1", row)
        assert "\n" not in str(info.value) and "tool_calls" in str(info.value)


# -- format ---------------------------------------------------------------------------------------------
def test_format_good_response():
    assert tool_format("Let me compute.\n" + call("calculator", expression="37 * 41") + "\nThe answer is 1517.", CALC) == 1.0


def test_format_missing_close_tag():
    response = 'Let me compute.\n<tool_call>{"name": "calculator", "arguments": {"expression": "37 * 41"}}\n1517'
    assert tool_format(response, CALC) == 0.0
    # a second call left open after a closed one
    assert tool_format(call("calculator", expression="1") + "\n<tool_call>{}\n1517", CALC) == 0.0


def test_format_stray_close_tag():
    assert tool_format(call("calculator", expression="37 * 41") + "</tool_call>\n1517", CALC) == 0.0


def test_format_broken_json_inside():
    response = '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>\n1517'
    assert tool_format(response, CALC) == 0.0
    assert tool_format('<tool_call>{"arguments": {}}</tool_call>\n1517', CALC) == 0.0  # no name


def test_format_no_final_answer_after_call():
    assert tool_format("Let me compute.\n" + call("calculator", expression="37 * 41") + "\n  \n", CALC) == 0.0


def test_format_calls_although_none_expected():
    assert tool_format(call("calculator", expression="2") + "\n2", {"answer": "2"}) == 0.0


def test_format_no_call_although_expected():
    assert tool_format("1517", CALC) == 0.0


def test_format_plain_row_plain_answer():
    assert tool_format("42", {"answer": "42"}) == 1.0
    assert tool_format("   ", {"answer": "42"}) == 0.0


# -- registration -----------------------------------------------------------------------------------------
def test_registered_and_safe_on_rows_without_tool_data():
    assert REWARDS["tool_format"] is tool_format and REWARDS["tool_correctness"] is tool_correctness
    scores = score_response(REWARDS, "42", {"answer": "42"})
    assert scores["tool_format"] == 1.0 and scores["tool_correctness"] == 3.0
    assert scores["exact_match"] == 1.0
