"""Verifiable rewards: functions of (response text, the prompt's row) -> float.

A prompt's row is the dict rollout reads from the run's prompt table (``prompt_id``, ``prompt``,
``answer``). Built-ins:

* ``exact_match``: the stripped response is the reference answer (the toy task);
* ``integer_format``: the response is a bare integer; ``answer_length``: it has the answer's length;
* ``answer_format``: the response is a short "Answer: ..." (the self-distillation task's format);
  ``answer_words``: the reference answer's words, in order, among the response's, in any format (number
  words equal to digits); ``answer_match``: both;
* ``math``: the response's final answer equals the reference by value. The final answer is the last
  ``\\boxed{...}`` (nested braces allowed), else the last ``#### ...`` line (GSM8K), else the last number;
  the reference is read the same way when it holds a full solution. Numbers compare exactly as
  fractions (``1,234``, ``-3``, ``0.5``, ``1/2``, ``\\frac{1}{2}`` and ``50\\%`` are understood); other
  answers compare with the ``math-verify`` package where it is installed (symbolic equivalence), and as
  normalized strings where it is not;
* ``math_format``: 1 when the response states a final answer as ``\\boxed{...}`` or a ``#### ...`` line;
* ``tool_format``: 1 when every ``<tool_call>`` of the response (the student's turns; see
  :mod:`gndpo.pipeline.tasks.tools`) is closed and reads as a call, a final answer follows the last call, and
  the response calls a tool exactly when the row's ``tool_calls`` expects one (GDPO's tool-calling format
  reward, adapted to this call convention);
* ``tool_correctness``: in [-3, 3], how well the response's calls match the row's ``tool_calls`` by tool
  names, argument names and argument values (ToolRL's correctness reward, which GDPO uses for tool
  calling); 3 for exactly the expected calls.

A row's ``tool_calls`` is a list of ``{"name": ..., "arguments": {...}}``, or a JSON string holding one;
missing, None or empty means the prompt expects no call. Both tool rewards are defined on every row.

A user's own reward is named by import path, ``package.module:function``, wherever a reward name is
accepted (``reward``, ``method.outcome.rewards``); ``gndpo init`` imports it and calls it on the first
prompt before writing the run.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from fractions import Fraction
from typing import Callable

from gndpo.errors import GndpoError, first_line
from gndpo.pipeline.settings.schema import Config
from gndpo.pipeline.tasks.plugins import named_callable
from gndpo.pipeline.tasks.tools import CALL, ToolCall, parse_tool_call

Reward = Callable[[str, dict], float]


def exact_match(response: str, row: dict) -> float:
    """1 if the response, stripped, is exactly the reference answer."""
    return float(response.strip() == str(row["answer"]).strip())


def integer_format(response: str, row: dict) -> float:
    """1 if the response is a bare (possibly signed) integer, whatever its value."""
    return float(re.fullmatch(r"\s*-?\d+\s*", response) is not None)


def answer_length(response: str, row: dict) -> float:
    """Format: 1 if the stripped response has as many characters as the reference answer (the toy
    task's answers are fixed-width, so this rewards the format without looking at the digits)."""
    return float(len(response.strip()) == len(str(row["answer"]).strip()))


ANSWER_PREFIX, SHORT_ANSWER_WORDS = "Answer:", 8


def answer_format(response: str, row: dict) -> float:
    """Format: 1 if the response starts with "Answer:" and is at most 8 words long ("Answer: Paris."),
    the short-answer style the self-distillation demo's demonstrations show; its content is not checked."""
    text = response.strip()
    return float(text.startswith(ANSWER_PREFIX) and len(text.split()) <= SHORT_ANSWER_WORDS)


# Number words read as their digits, so "Four" and "4" are the same answer.
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}


def _words(text: str) -> list[str]:
    """Lower-case words and numbers, number words as digits ("Mexico City!" -> mexico, city)."""
    return [_NUMBER_WORDS.get(w, w) for w in re.findall(r"[a-z0-9]+", text.lower())]


def answer_words(response: str, row: dict) -> float:
    """Content, whatever the format: 1 if the reference answer's words appear, in order and next to each
    other, among the response's ("The capital of Mexico is Mexico City." for "Mexico City"; case and
    punctuation ignored, number words equal to their digits: "4" for "Four"). The privileged-answer
    task's correctness; a response naming several candidates is counted right if one is the answer."""
    want, got = _words(str(row["answer"])), _words(response)
    return float(bool(want) and any(got[i:i + len(want)] == want for i in range(len(got) - len(want) + 1)))


def answer_match(response: str, row: dict) -> float:
    """Format and content: 1 if ``answer_format`` holds and ``answer_words`` does ("Answer: Mexico
    City." for "Mexico City"). The self-distillation task's correctness reward: sparse where the format
    reward alone is not, since the answer must also be right."""
    return answer_words(response, row) if answer_format(response, row) else 0.0


# -- math ---------------------------------------------------------------------------------------------
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
# Thousands with commas first, so "1,234" is one number; otherwise a signed integer, decimal or a/b.
_NUMBER = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?\d+(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")


def boxed_answer(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with its braces balanced, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def hashes_answer(text: str) -> str | None:
    """What follows the last ``####`` (GSM8K's answer line), or None when there is none or it is empty."""
    lines = [m.group(1).strip() for m in _HASHES.finditer(text)]
    return lines[-1] if lines and lines[-1] else None


def final_answer(text: str) -> str | None:
    """The answer a solution ends with: last boxed, else last ``####`` line, else last number."""
    boxed = boxed_answer(text)
    if boxed is not None:
        return boxed
    hashes = hashes_answer(text)
    if hashes is not None:
        return hashes
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _strip_latex(s: str) -> str:
    s = re.sub(r"\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}", "", s)  # units and words
    for token in ("\\!", "\\,", "\\;", "\\left", "\\right", "\\$", "$", "\\%", "%", "^\\circ", "^{\\circ}"):
        s = s.replace(token, "")
    return s.strip().rstrip(".").strip()


_FRAC = re.compile(r"([-+]?)\\[dt]?frac\{\s*([-+]?\d+)\s*\}\{\s*([-+]?\d+)\s*\}")


def to_number(answer: str) -> Fraction | None:
    """An answer as an exact number, or None when it is not one."""
    s = _strip_latex(answer).replace(" ", "")
    m = _FRAC.fullmatch(s)
    if m:
        if int(m.group(3)) == 0:
            return None
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return -value if m.group(1) == "-" else value
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    try:
        return Fraction(s) if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)(/[-+]?\d+)?", s) else None
    except (ValueError, ZeroDivisionError):
        return None


def _reference(answer: str) -> str:
    """The reference's final answer: a stored full solution (``####`` or boxed) is reduced to it."""
    text = str(answer)
    if boxed_answer(text) is not None or "####" in text:
        return final_answer(text) or text.strip()
    return text.strip()


def _symbolic_equal(got: str, want: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:  # documented fallback: normalized string comparison
        return _strip_latex(got).replace(" ", "") == _strip_latex(want).replace(" ", "")
    return bool(verify(parse(f"${want}$"), parse(f"${got}$")))


def math_answer(response: str, row: dict) -> float:
    """1 if the response's final answer equals the reference's, by value."""
    got = final_answer(response)
    if got is None or not got.strip():
        return 0.0
    want = _reference(row["answer"])
    got_n, want_n = to_number(got), to_number(want)
    if got_n is not None or want_n is not None:
        return float(got_n == want_n)
    return float(_symbolic_equal(got, want))


def math_format(response: str, row: dict) -> float:
    """Format: 1 if the response states its final answer as ``\\boxed{...}`` or a ``#### ...`` line."""
    return float(bool(boxed_answer(response)) or hashes_answer(response) is not None)


# -- tool use ----------------------------------------------------------------------------------------
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def expected_tool_calls(row: dict) -> list[ToolCall]:
    """The row's ``tool_calls`` as ToolCalls ([] when missing, None or empty); a ValueError when it is
    not a list of ``{"name": str, "arguments": {...}}`` (or a JSON string holding one)."""
    raw = row.get("tool_calls")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"the row's tool_calls is not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"the row's tool_calls must be a list of calls, not {type(raw).__name__}")
    calls = []
    for i, call in enumerate(raw):
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
                and isinstance(call.get("arguments"), dict)):
            raise ValueError(f'the row\'s tool_calls[{i}] must be {{"name": "<tool>", "arguments": {{...}}}}')
        calls.append(ToolCall(call["name"], call["arguments"]))
    return calls


def _blocks(response: str) -> list[ToolCall | str]:
    """Every ``<tool_call>...</tool_call>`` block of the response in order, each read by
    :func:`parse_tool_call` (a ToolCall, or a string saying why it cannot be read)."""
    return [parse_tool_call(m.group(0)) for m in CALL.finditer(response)]


def tool_format(response: str, row: dict) -> float:
    """Format for tool use: 1 iff every ``<tool_call>`` is closed by its own ``</tool_call>`` (and none
    closes nothing), every call reads as ``{"name": ..., "arguments": {...}}``, non-blank text (the final
    answer) follows the last call (or makes up a response without calls), and the response holds a call
    if and only if the row's ``tool_calls`` expects one. GDPO's format reward for tool calling, adapted
    to the ``<tool_call>`` convention of :mod:`gndpo.pipeline.tasks.tools`."""
    expected = expected_tool_calls(row)
    matches = list(CALL.finditer(response))
    opens, closes = response.count(_OPEN), response.count(_CLOSE)
    if not (opens == closes == len(matches)):
        return 0.0
    if not all(isinstance(parse_tool_call(m.group(0)), ToolCall) for m in matches):
        return 0.0
    answer = response[matches[-1].end():] if matches else response
    if not answer.strip():
        return 0.0
    return float(bool(matches) == bool(expected))


def _match_score(l1: list, l2: list) -> float:
    """ToolRL's list similarity: 1 for equal lists, 0 when either is empty, else the multiset Jaccard
    index |l1 & l2| / (|l1| + |l2| - |l1 & l2|)."""
    if l1 == l2:
        return 1.0
    if not l1 or not l2:
        return 0.0
    common = sum((Counter(l1) & Counter(l2)).values())
    return common / (len(l1) + len(l2) - common)


def tool_correctness(response: str, row: dict) -> float:
    """Correctness of the response's tool calls against the row's ``tool_calls``, in [-3, 3].

    The correctness reward of ToolRL (Qian et al. 2025, "ToolRL: Reward is All Tool Learning Needs"),
    which GDPO uses for its tool-calling task. The predicted calls are every ``<tool_call>`` block of the
    response that reads as a call, in order (blocks that do not are skipped). Then:

    * predicted calls == expected calls (names and arguments, in order): 3;
    * otherwise ``score = match(expected names, predicted names)`` and ``max = 1``, where ``match`` is 1
      for equal lists, 0 when either is empty, else the multiset Jaccard index; for each expected call in
      order, ``max += 1 + its argument count``, and among the predicted calls of the same name not yet
      used, the one with the greatest (strictly above 0, first wins ties)
      ``match(expected argument names, predicted argument names) + number of expected arguments whose
      value the predicted call repeats`` is used up and that total added to ``score``;
    * reward = ``6 * score / max - 3``.

    Argument values compare with ``==`` after JSON decoding (``"37*41"`` differs from ``"37 * 41"``;
    ``2 == 2.0``). With no call expected and none made the reward is 3; any call made then is -3.
    """
    expected = expected_tool_calls(row)
    predicted = [c for c in _blocks(response) if isinstance(c, ToolCall)]
    if [(c.name, c.arguments) for c in predicted] == [(c.name, c.arguments) for c in expected]:
        return 3.0
    score = _match_score([c.name for c in expected], [c.name for c in predicted])
    local_max = 1.0
    used: set[int] = set()
    for want in expected:
        local_max += 1 + len(want.arguments)
        best, best_total = None, 0.0
        for i, got in enumerate(predicted):
            if i in used or got.name != want.name:
                continue
            total = _match_score(list(want.arguments), list(got.arguments)) + sum(
                1 for key, value in want.arguments.items() if key in got.arguments and got.arguments[key] == value
            )
            if total > best_total:
                best, best_total = i, total
        if best is not None:
            used.add(best)
            score += best_total
    return 6 * score / local_max - 3


# Rollout stores every built-in (and every custom reward the run names) per response, in the
# ``rewards`` map, so GDPO and the logs can use any of them; ``reward`` in the config names the primary
# one (accuracy, pass rates, the GRPO default).
REWARDS: dict[str, Reward] = {
    "exact_match": exact_match,
    "integer_format": integer_format,
    "answer_length": answer_length,
    "answer_format": answer_format,
    "answer_match": answer_match,
    "answer_words": answer_words,
    "math": math_answer,
    "math_format": math_format,
    "tool_format": tool_format,
    "tool_correctness": tool_correctness,
}


# The built-ins that never read the row's reference answer (formats; the tool rewards read tool_calls).
ANSWER_FREE = frozenset({"integer_format", "answer_format", "math_format", "tool_format", "tool_correctness"})


def reads_answer(name: str) -> bool:
    """Whether reward ``name`` may read the row's reference answer (a user's reward is taken to)."""
    return name not in ANSWER_FREE


def get_reward(name: str) -> Reward:
    """A built-in reward by name, or a user's by import path ``module:function``; a GndpoError otherwise."""
    return named_callable(name, REWARDS, "reward")


def run_rewards(cfg: Config, with_answers: bool = True) -> dict[str, Reward]:
    """Every reward a run records per response: the built-ins plus the custom ones the config names;
    without answers (prompts that have none), only those that do not read one."""
    named = [cfg.reward, *cfg.method.outcome.rewards]
    rewards = {**REWARDS, **{name: get_reward(name) for name in named if name not in REWARDS}}
    return rewards if with_answers else {name: fn for name, fn in rewards.items() if not reads_answer(name)}


def score_response(rewards: dict[str, Reward], response: str, row: dict) -> dict[str, float]:
    """{name: reward} of one response; a reward that raises or returns a non-number is a GndpoError
    naming it and the prompt."""
    out = {}
    for name, fn in rewards.items():
        try:
            value = fn(response, row)
            value = float(value)
        except Exception as exc:
            raise GndpoError(
                f"reward {name!r} failed on prompt {row.get('prompt_id', '?')}: {first_line(exc, with_type=True)}"
            ) from None
        if not math.isfinite(value):
            raise GndpoError(f"reward {name!r} returned {value} on prompt {row.get('prompt_id', '?')}; rewards must be finite numbers")
        out[name] = value
    return out


def check_rewards(cfg: Config, row: dict) -> None:
    """Import every reward the config names and call each on ``row`` (with its reference answer, or
    without one its prompt, as the response), so a broken reward is refused at init, not in the middle
    of a rollout."""
    with_answers = row.get("answer") is not None
    score_response(run_rewards(cfg, with_answers), str(row["answer"] if with_answers else row["prompt"]), row)
