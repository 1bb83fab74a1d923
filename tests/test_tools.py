"""Tool calls: the call format, the built-in tools, and every way a call can fail without stopping a
rollout (broken JSON, unknown tool, a tool that raises, returns garbage or runs past its time limit)."""

import time

import pytest

from gndpo.errors import GndpoError
from gndpo.pipeline.tasks.tools import TOOLS, ToolCall, calculator, get_tool, parse_tool_call, run_tool_call

ROW = {"prompt_id": "p1", "lookup": '{"capital_of_france": "Paris", "answer": 42}'}


def call(name, **arguments):
    import json

    return f"Let me check. <tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_parse_reads_the_first_call_and_its_arguments():
    assert parse_tool_call("no call here") is None
    text = call("calculator", expression="1+2") + call("lookup", key="x")
    assert parse_tool_call(text) == ToolCall("calculator", {"expression": "1+2"})
    # arguments serialized a second time, as some chat templates do
    assert parse_tool_call('<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call>') == ToolCall("lookup", {"key": "a"})


@pytest.mark.parametrize("body, reason", [
    ('{"name": "calculator", "arguments": {"expression": "1+2"', "not valid JSON"),
    ('["calculator"]', "needs"),
    ('{"arguments": {}}', "needs"),
    ('{"name": "calculator", "arguments": [1, 2]}', "not a JSON object"),
])
def test_unreadable_calls_become_error_turns(body, reason):
    result = run_tool_call(f"<tool_call>{body}</tool_call>", TOOLS, ROW, timeout_s=1)
    assert not result.ok and result.text.startswith("error: ") and reason in result.text and "\n" not in result.text


@pytest.mark.parametrize("expression, value", [
    ("37 * 41", "1517"), ("(2 + 3) * -4", "-20"), ("7 // 2", "3"), ("7 % 4", "3"), ("2 ** 10", "1024"),
    ("1 / 4", "0.25"), ("0.1 + 0.2", "0.3"), ("123456789 * 987654321", str(123456789 * 987654321)),
])
def test_calculator_is_exact(expression, value):
    assert calculator({"expression": expression}, ROW) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "2 ** 100000", "1 / 0", "x + 1", "1 +", "9 ** 9 ** 9"])
def test_calculator_refuses_what_is_not_plain_arithmetic(expression):
    result = run_tool_call(call("calculator", expression=expression), TOOLS, ROW, timeout_s=2)
    assert not result.ok and result.text.startswith("error: calculator: ")


def test_lookup_reads_the_prompt_row():
    assert run_tool_call(call("lookup", key="capital_of_france"), TOOLS, ROW, 1).text == "Paris"
    assert run_tool_call(call("lookup", key="answer"), TOOLS, ROW, 1).text == "42"
    missing = run_tool_call(call("lookup", key="nope"), TOOLS, ROW, 1)
    assert not missing.ok and "no entry 'nope'" in missing.text


def test_unknown_tool_lists_the_available_ones():
    result = run_tool_call(call("browser", url="x"), {"calculator": calculator}, ROW, 1)
    assert result == type(result)("browser", "error: unknown tool 'browser'; available: calculator", False)


def test_user_tools_by_import_path_and_their_failures():
    tools = {name: get_tool(f"tests.custom_tools:{name}") for name in ("reverse", "broken", "slow", "garbage", "structured")}
    assert run_tool_call(call("reverse", text="abc"), tools, ROW, 1).text == "cba"
    assert run_tool_call(call("structured"), tools, ROW, 1).text == '{"rows": [1, 2]}'
    raised = run_tool_call(call("broken"), tools, ROW, 1)
    assert not raised.ok and raised.text == "error: broken: RuntimeError: the service is down"
    junk = run_tool_call(call("garbage"), tools, ROW, 1)
    assert not junk.ok and "returned object" in junk.text
    t0 = time.time()
    late = run_tool_call(call("slow"), tools, ROW, timeout_s=0.3)
    assert time.time() - t0 < 2 and not late.ok and late.text == "error: slow did not answer within 0.3 s"
    missing_args = run_tool_call(call("reverse"), tools, ROW, 1)
    assert not missing_args.ok and "KeyError" in missing_args.text


def test_bad_tool_names_are_one_line_errors():
    with pytest.raises(GndpoError, match="unknown tool 'nope'; choose one of: calculator, lookup"):
        get_tool("nope")
    with pytest.raises(GndpoError, match="tool 'tests.no_such_module:f' does not import: ModuleNotFoundError"):
        get_tool("tests.no_such_module:f")
    with pytest.raises(GndpoError, match="has no function 'missing'"):
        get_tool("tests.custom_tools:missing")


@pytest.fixture(scope="module")
def chatml_tokenizer():
    """A small byte-level BPE with a ChatML template (im_start / im_end turns), as Qwen-style models have."""
    from tests.realistic import ShapeSpec, build_tokenizer

    return build_tokenizer(ShapeSpec(tokenizer_vocab=600, corpus_lines=500, corpus_words=200))


def test_tool_turn_closes_the_call_and_reopens_the_assistant(chatml_tokenizer):
    from gndpo.pipeline.settings.schema import DataConfig
    from gndpo.stages.text.chat import tool_turn_ids

    ids = tool_turn_ids(chatml_tokenizer, {"prompt": "What is 37 * 41?"}, DataConfig(), "1517")
    text = chatml_tokenizer.decode(ids)
    assert text == "<|im_end|>\n<|im_start|>tool\n1517<|im_end|>\n<|im_start|>assistant\n"
    im_end = chatml_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids[0] == im_end and ids.count(im_end) == 2


def test_a_template_without_tool_turns_is_refused(chatml_tokenizer):
    from gndpo.pipeline.settings.schema import DataConfig
    from gndpo.stages.text.chat import tool_turn_ids

    tok = chatml_tokenizer
    original = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}|{% endif %}{% endfor %}"
        with pytest.raises(GndpoError, match="drops tool turns"):
            tool_turn_ids(tok, {"prompt": "q"}, DataConfig(), "1517")
        tok.chat_template = "{{ raise_exception('tools are not supported') }}"
        with pytest.raises(GndpoError, match="cannot render a tool turn: .*tools are not supported"):
            tool_turn_ids(tok, {"prompt": "q"}, DataConfig(), "1517")
    finally:
        tok.chat_template = original
