"""The embedded tool-use default: two-digit multiplication with a calculator, a student that has only
partly learnt to use it, and a teacher that uses it every time.

A prompt is ``a*b`` (10 <= a, b <= 99) as one user turn and the answer is the product. Neither model can
multiply; the calculator can. A correct response is a call, the tool's answer, and the answer copied::

    <|assistant|><tool_call>{"name": "calculator", "arguments": {"expression": "37*41"}}</tool_call><|end|>
    <|tool|>1517<|end|><|assistant|>1517<|end|>

Everything is built from a seed without a model hub and cached under ``$GNDPO_CACHE`` like the addition
toy (:mod:`gndpo.apps.demos.arithmetic`): a character tokenizer over printable ASCII (so tool results and error
messages are spelt exactly) with role markers, an end-of-turn token, and the call's fixed parts as
single tokens; a chat template that renders tool turns; prompts with their ``tool_calls`` ground truth;
and one Llama trained twice. It first learns tool conversations only, and is saved as the teacher
when its greedy exact match passes ``teacher_target``; it then goes on with conversations of which only
``student_tool_share`` call the calculator (the rest answer directly and cannot be right), and is saved
as the student once greedy decoding opens with a call on at most ``student_call_share`` of the
validation prompts. So the student has learnt to call and to copy (the call's expression and the
tool's answer) and has unlearnt deciding to; both checkpoints are chosen by measurement, not by a step
count, because how fast a toy learns differs between CPU types: on an AMD EPYC the student saved
after a fixed 300 steps of the mixed data (the previous build) wrote 19% of the held-out tool
conversations right once the call was opened for it, the student chosen this way 78%. Training
conversations are built with the
rollout's own rendering (:func:`render_prompt`, :func:`tool_turn_ids`) and loss mask, so they are
token for token what the student produces in a rollout.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gndpo.apps.demos.arithmetic import (
    CHAT_TEMPLATE,
    END_OF_TURN,
    ModelSpec,
    character_tokenizer,
    new_model,
    padded_batch,
    spec_key,
    train_supervised,
)
from gndpo.apps.demos.build import pinned_build, use_build_threads
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.settings.schema import DataConfig
from gndpo.stages.text.chat import render_prompt, tool_turn_ids
from gndpo.storage.cache import cached_build

ROLES = ("system", "user", "assistant", "tool")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_HEAD, CALL_TAIL = '{"name": "calculator", "arguments": {"expression": "', '"}}'


@dataclass(frozen=True)
class ToolToySpec:
    """Everything that determines the built files; its hash names the cache folder."""

    low: int = 10
    high: int = 99
    n_train_prompts: int = 4096
    n_heldout: int = 500
    seed: int = 7
    model: ModelSpec = field(default_factory=lambda: ModelSpec(layers=2, hidden=128, heads=4, max_steps=3000, lr=3e-3))
    teacher_target: float = 0.97
    student_tool_share: float = 0.2
    student_call_share: float = 0.05
    student_max_steps: int = 1000  # the most steps after the teacher's checkpoint
    context: int = 128
    # bumped when the built files change for a given spec (2: pinned arithmetic; 3: teacher first)
    assets_version: int = 3

    def key(self) -> str:
        return spec_key(self)


# -- the task ---------------------------------------------------------------------------------------


def is_heldout(a: int, b: int, seed: int) -> bool:
    """A fixed 1/16 of all pairs is held out; training never samples from it."""
    return hashlib.sha1(f"{seed}:{a}*{b}".encode()).digest()[0] < 16


def sample_pairs(rng: random.Random, n: int, spec: ToolToySpec, heldout: bool) -> list[tuple[int, int]]:
    out, seen = [], set()
    while len(out) < n:
        a, b = rng.randint(spec.low, spec.high), rng.randint(spec.low, spec.high)
        if is_heldout(a, b, spec.seed) == heldout and (a, b) not in seen:
            seen.add((a, b))
            out.append((a, b))
    return out


def task_row(a: int, b: int) -> dict:
    expression = f"{a}*{b}"
    return {
        "prompt": expression, "answer": str(a * b),
        "tool_calls": json.dumps([{"name": "calculator", "arguments": {"expression": expression}}]),
    }


def call_text(expression: str) -> str:
    return f"{CALL_OPEN}{CALL_HEAD}{expression}{CALL_TAIL}{CALL_CLOSE}"


# -- tokenizer --------------------------------------------------------------------------------------


def build_tokenizer():
    """A character-level fast tokenizer over printable ASCII with role markers, an end-of-turn token and
    the call's fixed parts as single tokens; its template renders system, user, assistant and tool turns."""
    from tokenizers import AddedToken

    fast = character_tokenizer(string.printable[:95], model_max_length=256)  # digits, letters, punctuation, space
    fast.add_special_tokens({"additional_special_tokens": [f"<|{r}|>" for r in ROLES] + [END_OF_TURN]})
    # Not special: decoded text keeps them, so rewards and the tool parser see the call.
    fast.add_tokens([AddedToken(t, normalized=False, special=False) for t in (CALL_OPEN, CALL_CLOSE, CALL_HEAD, CALL_TAIL)])
    fast.chat_template = CHAT_TEMPLATE
    return fast


# -- training conversations ---------------------------------------------------------------------------


class Conversations:
    """Token sequences and loss masks of the two ways to answer a prompt, built with rollout's rendering."""

    def __init__(self, tok):
        self.tok, self.data = tok, DataConfig()
        self._render, self._tool_turn = render_prompt, tool_turn_ids
        self.end = tok.convert_tokens_to_ids(END_OF_TURN)
        self.call_open = tok.convert_tokens_to_ids(CALL_OPEN)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt(self, row: dict) -> list[int]:
        return self._render(self.tok, row, self.data).token_ids

    def with_tool(self, row: dict) -> tuple[list[int], list[int]]:
        """(response ids, loss mask): the call, the tool turn (mask 0), the answer and end of turn."""
        call = self._ids(call_text(row["prompt"]))
        tool = self._tool_turn(self.tok, row, self.data, row["answer"])
        answer = self._ids(row["answer"]) + [self.end]
        return call + tool + answer, [1] * len(call) + [0] * len(tool) + [1] * len(answer)

    def direct(self, row: dict) -> tuple[list[int], list[int]]:
        answer = self._ids(row["answer"]) + [self.end]
        return answer, [1] * len(answer)

    def batch(self, rows: list[dict], tool_flags: list[bool]):
        seqs, masks = [], []
        for row, tool in zip(rows, tool_flags):
            p = self.prompt(row)
            response, mask = self.with_tool(row) if tool else self.direct(row)
            seqs.append(p + response)
            masks.append([0] * len(p) + mask)
        return padded_batch(seqs, masks, self.tok.pad_token_id)

    def greedy_accuracy(self, model, rows: list[dict]) -> tuple[float, float]:
        """(exact match, share of prompts answered with a call) of greedy decoding, computed exactly by
        teacher forcing: greedy opens with a call iff the call token is the argmax of the first response
        position, and then reproduces a whole conversation iff the argmax is the target at every
        position the student writes (the tool's answer is then the one in the conversation)."""
        import torch

        right = calls = 0
        with torch.no_grad():
            for start in range(0, len(rows), 256):
                chunk = rows[start : start + 256]
                tool_ids, tool_mask = self.batch(chunk, [True] * len(chunk))
                direct_ids, direct_mask = self.batch(chunk, [False] * len(chunk))
                tool_ok = _all_argmax_right(model, tool_ids, tool_mask)
                direct_ok = _all_argmax_right(model, direct_ids, direct_mask)
                first = torch.tensor([len(self.prompt(r)) for r in chunk])
                logits = model(input_ids=tool_ids).logits
                opens_call = logits[torch.arange(len(chunk)), first - 1].argmax(-1) == self.call_open
                calls += int(opens_call.sum())
                right += int(torch.where(opens_call, tool_ok, direct_ok).sum())
        return right / len(rows), calls / len(rows)


def _all_argmax_right(model, ids, mask):
    logits = model(input_ids=ids).logits[:, :-1]
    hit = (logits.argmax(-1) == ids[:, 1:]) | (mask[:, 1:] == 0)
    return hit.all(-1)


# -- building and caching ---------------------------------------------------------------------------


def ensure_tool_toy_assets(spec: ToolToySpec = ToolToySpec(), log=info) -> Path:
    """Return the folder with the built tool-use toy, building it first if it is not cached."""
    return cached_build(f"toy-tools-{spec.key()}", pinned_build(build_tool_toy, spec, log=log))


def build_tool_toy(spec: ToolToySpec, out: Path, log=info) -> dict:
    import torch

    use_build_threads()
    tok = build_tokenizer()
    convs = Conversations(tok)
    rng = random.Random(spec.seed)
    heldout = [task_row(a, b) for a, b in sample_pairs(rng, spec.n_heldout, spec, heldout=True)]
    train = [task_row(a, b) for a, b in sample_pairs(rng, spec.n_train_prompts, spec, heldout=False)]
    for name, rows in (("train", train), ("heldout", heldout)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    validation = [task_row(a, b) for a, b in sample_pairs(random.Random(f"val:{spec.seed}"), 256, spec, heldout=False)]

    info = {"spec": asdict(spec), "key": spec.key()}
    m = spec.model
    torch.manual_seed(spec.seed)
    model = new_model(m, vocab_size=len(tok), context=spec.context)
    share = {"value": 1.0}  # the teacher learns tool conversations only

    def next_batch(batch_rng):
        rows = [task_row(a, b) for a, b in sample_pairs(batch_rng, m.batch, spec, heldout=False)]
        return convs.batch(rows, [batch_rng.random() < share["value"] for _ in rows])

    def save(role: str, step: int, _validation: float) -> None:
        acc, calls = convs.greedy_accuracy(model, heldout)
        log(f"  {role}: held-out greedy exact match {acc:.3f}, calls the calculator on {calls:.3f} of prompts, after {step} steps")
        info.update({f"{role}_heldout_accuracy": acc, f"{role}_tool_share": calls, f"{role}_steps": step})
        model.save_pretrained(out / role, safe_serialization=True)
        tok.save_pretrained(out / role)
        share["value"] = spec.student_tool_share  # the student goes on mostly without the calculator

    def validate(milestone: str) -> float:
        """The teacher: greedy exact match; the student: the share of prompts greedy answers without a call."""
        accuracy, calls = convs.greedy_accuracy(model, validation)
        return accuracy if milestone == "teacher" else 1.0 - calls

    log(f"building the tool-use toy: {m.layers} layers x {m.hidden} wide, at most {m.max_steps} steps")
    milestones = [("teacher", spec.teacher_target, m.max_steps - spec.student_max_steps),
                  ("student", 1.0 - spec.student_call_share, m.max_steps)]
    train_supervised(model, m, spec.seed, next_batch, validate, milestones, save, log=log)
    info["parameters"] = sum(p.numel() for p in model.parameters())
    (out / "info.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    return info
