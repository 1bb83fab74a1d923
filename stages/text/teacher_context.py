"""The teacher's prompt: the student's, or a privileged context only the teacher sees.

On-policy self-distillation (OPSD) scores the student's own responses with a teacher that is given
more than the student was: the verified solution, the answer, or worked demonstrations. Score then runs
the teacher over ``[teacher prompt | the student's response ids]`` and slices its log-probs back to the
response positions, so every method sees per-token teacher numbers exactly as with a separate teacher.

``teacher_context.messages`` are the teacher's turns; each turn's content is a Python format string
over the prompt row's columns (``{prompt}``, ``{answer}``, or any column of the prompts file, which
``gndpo init`` keeps). They go through the teacher's chat template with the generation prompt, the way
:func:`gndpo.stages.text.chat.render_prompt` renders the student's; a teacher without a template gets the
contents joined by blank lines, with its own special tokens (a base model's BOS).

With ``teacher_context.other_problem`` (the OP2SD ablation) every placeholder but ``{prompt}`` is
filled from another prompt of the training set: prompts are put in a seeded order and each takes its
successor's columns, so no prompt is ever paired with its own solution and the pairing does not
depend on which worker scores it.

With images, a vision-language teacher reads the row's pictures through its own processor, as verl's
teachers do: a teacher of another size or image resolution expands each ``<image>`` placeholder into its
own number of image tokens. The context's turns must then place one placeholder per picture, usually
through ``{prompt}``, whose text carries the student's (checked at ``gndpo init``). A text-only teacher
cannot see a picture: it reads the context with every ``<image>`` placeholder left out, so the context
must give it the picture's information as text (a caption or data column of the prompts file).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from gndpo.errors import GndpoError, first_line
from gndpo.pipeline.run.images import PLACEHOLDER, image_ids, with_image_parts
from gndpo.pipeline.settings.schema import DataConfig, TeacherContextConfig
from gndpo.stages.models.vision import expanded_prompt_ids, placeholder_count
from gndpo.stages.text.chat import render_prompt, uses_template

OWN_COLUMN = "prompt"  # the one placeholder that always comes from the prompt itself


def other_problem_partners(prompt_ids: list[str], seed: int) -> dict[str, str]:
    """{prompt id: the id of the prompt whose context it borrows}: a seeded cycle through all prompts,
    so no prompt is its own partner (given at least two)."""
    order = sorted(prompt_ids)
    random.Random(f"gndpo-op2sd:{seed}").shuffle(order)
    return {pid: order[(i + 1) % len(order)] for i, pid in enumerate(order)}


class TeacherPrompts:
    """Renders each prompt row as the teacher sees it, with the teacher's tokenizer (and, for rows with
    pictures, its processor)."""

    def __init__(self, tok, data: DataConfig, context: TeacherContextConfig, rows: list[dict], processor=None,
                 pictures: Callable[[str], object] | None = None):
        """``processor``/``pictures``: the teacher's processor and a map from image id to PIL image, for
        runs whose prompts show pictures."""
        self.tok, self.data, self.context = tok, data, context
        self.processor, self.pictures = processor, pictures
        self._expanded: dict[str, list[int]] = {}  # a prompt's n samples share its expansion
        self.by_id = {r["prompt_id"]: r for r in rows}
        self.partners = {}
        if context.other_problem:
            if len(rows) < 2:
                raise GndpoError("teacher_context.other_problem needs at least two training prompts")
            self.partners = other_problem_partners(list(self.by_id), context.seed)

    def fields(self, row: dict) -> dict:
        """The values the context's placeholders are filled with for ``row``."""
        values = {k: ("" if v is None else str(v)) for k, v in row.items()}
        if self.partners:
            other = self.by_id[self.partners[row["prompt_id"]]]
            values.update({k: ("" if other.get(k) is None else str(other[k])) for k in self.context.columns() if k != OWN_COLUMN})
        return values

    def turns(self, row: dict) -> list[dict]:
        fields = self.fields(row)
        # A multimodal template takes each picture as an image part, as the student's rendering does; a
        # text-only teacher reads the text around the pictures.
        as_content = lambda text: text  # noqa: E731
        if image_ids(row):
            as_content = with_image_parts if self.processor is not None else (lambda text: text.replace(PLACEHOLDER, ""))
        try:
            return [{"role": t["role"], "content": as_content(t["content"].format(**fields))} for t in self.context.messages]
        except (KeyError, IndexError) as exc:
            missing = first_line(exc, with_type=True)
            raise GndpoError(f"teacher_context.messages names {missing}, which prompt {row.get('prompt_id', '?')} does not have") from None

    def unexpanded(self, row: dict) -> tuple[str, list[int], bool]:
        """The teacher's prompt text for ``row``, its ids with one placeholder token per picture (the
        student's rendering when there is no context), and whether the tokenizer added its special
        tokens (a bare text's BOS) to those ids."""
        if not self.context.messages:
            rendered = render_prompt(self.tok, row, self.data)
            return rendered.text, rendered.token_ids, not uses_template(self.tok, self.data)
        turns = self.turns(row)
        if not uses_template(self.tok, self.data):
            text = "\n\n".join(t["content"] for t in turns)
            return text, list(self.tok(text)["input_ids"]), True
        try:
            text = self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **self.data.template_kwargs)
        except Exception as exc:  # jinja errors, a template's own raise_exception(...)
            raise GndpoError(f"the teacher's chat template cannot render the teacher context of prompt {row.get('prompt_id', '?')}: "
                             f"{first_line(exc, with_type=True)}") from None
        return text, list(self.tok(text, add_special_tokens=False)["input_ids"]), False

    def images(self, row: dict) -> list:
        """``row``'s pictures (PIL images, in placeholder order); empty without images."""
        return [self.pictures(i) for i in image_ids(row)] if self.pictures else []

    def token_ids(self, row: dict) -> list[int]:
        """The ids the teacher's forward reads for ``row``: with pictures, each placeholder expanded by the
        teacher's processor (once per prompt: its n samples share it); a GndpoError where the
        placeholders do not match the pictures."""
        if not (self.pictures and image_ids(row)):
            return self.unexpanded(row)[1]
        if row["prompt_id"] not in self._expanded:
            text, ids, special_tokens = self.unexpanded(row)
            pictures = self.images(row)
            if (shown := placeholder_count(self.processor, ids)) != len(pictures):
                raise GndpoError(f"the teacher's prompt for prompt {row.get('prompt_id', '?')} has {shown} image placeholder(s) "
                                 f"for its {len(pictures)} image(s): put {{prompt}} (or <image>) in teacher_context.messages")
            self._expanded[row["prompt_id"]] = expanded_prompt_ids(self.processor, text, pictures, add_special_tokens=special_tokens)
        return self._expanded[row["prompt_id"]]
