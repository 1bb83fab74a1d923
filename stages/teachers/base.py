"""The teacher interface: what a backend can give (:class:`Capabilities`), what score asks of the
teacher it builds (:class:`Teacher`), and the backend itself (:class:`TeacherBackend`): how it is built
on a score worker's round and how it is checked at ``gndpo init`` and at each worker's start.

Every teacher runs the student's forward (:class:`~gndpo.stages.scoring.forward.StudentForward`, the
same function train differentiates, so the importance ratio at a round's first step is 1 up to float
error) and adds the teacher's columns its own way. Several teachers are routed (each prompt to the
teacher its row names) or mixed (the mean of their distributions), per ``score.teacher_mix``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from gndpo.pipeline.settings.schema import Config
from gndpo.stages.scoring.forward import Scored, UnitRows
from gndpo.stages.teachers.setup import ScoreSetup
from gndpo.stages.text.cross_tokenizer import TeacherColumns
from gndpo.stages.text.teacher_context import TeacherPrompts


@dataclass(frozen=True)
class Capabilities:
    """What a backend can give, as init's checks and the GPU estimate ask it (never its name)."""

    full_distribution: bool  # the teacher's logits at every position: its entropy, the full-vocabulary KL
    mixes_topk: bool  # several teachers' top-k under score.teacher_mix mean (needs each one's whole distribution)
    weights_beside_student: bool  # the teachers' weights sit in score's process beside the student's
    engine: bool  # a vLLM engine in score's process (score.engine: its context length, its share of the GPU)
    served: bool  # scored by servers (score.servers): init records their answers, each worker holds them to it


class Teacher(Protocol):
    """What score asks of a teacher: a unit's rows scored into the stored per-token columns."""

    def score(self, rows: UnitRows, topk: int) -> Scored:
        """The student's and the teacher's per-token columns of ``rows``, flat over their response
        tokens (``topk``: the teacher's top-k width, 0 for none), and the teacher recorded per row."""


class TeacherBackend(ABC):
    """One value of ``score.backend``: built on a score worker's round (:class:`ScoreSetup`), it makes
    the :class:`Teacher` that scores every unit, and, for a teacher of another tokenizer, the source of
    that teacher's numbers over its own tokens (:meth:`columns`)."""

    capabilities: ClassVar[Capabilities]

    def __init__(self, setup: ScoreSetup):
        self.setup = setup

    @abstractmethod
    def teacher(self, teachers: dict[str, str]) -> Teacher:
        """The teacher of the round's ``teachers`` ({name recorded per row: local folder}), which share
        the student's tokenizer."""

    @abstractmethod
    def columns(self, name: str, path: str, prompts: TeacherPrompts) -> TeacherColumns:
        """The numbers of the teacher ``name`` at ``path`` over its own tokens (``score.cross_tokenizer``);
        ``prompts``: how it renders each prompt."""

    def counts(self) -> dict[str, int]:
        """This worker's counters so far that the round's score metrics sum (a served teacher's retries)."""
        return {}

    def live_state(self) -> dict:
        """What `gndpo status` shows of a worker of this backend while it holds a unit."""
        return {}

    @classmethod
    def check_teachers(cls, cfg: Config, local: Config, with_images: bool, recorded: dict | None = None) -> dict[str, list[float]]:
        """At ``gndpo init`` (and fork), once the models are known: a one-line GndpoError where this
        backend cannot score the run's teachers (``local`` names their folders, ``cfg`` the config as
        written). Returns what run.yaml keeps for every worker to hold the teachers to (``recorded``:
        a fork's parent's); nothing for a backend that reads the teacher's own files."""
        return {}


def teacher_groups(prompt_ids: list[str], names: list[str], routes: dict[str, str]) -> list[tuple[str, list[str], list[int]]]:
    """(label recorded per row, the names of the teachers that score those rows, the rows): with
    ``routes`` ({prompt id: teacher name}, score.teacher_mix route) each row's routed teacher, else
    every row to the one teacher, or to the mean of all (score.teacher_mix mean)."""
    if routes:
        members: dict[str, list[int]] = {}
        for i, pid in enumerate(prompt_ids):
            members.setdefault(routes[pid], []).append(i)
        return [(name, [name], rows) for name, rows in members.items()]
    label = names[0] if len(names) == 1 else f"mean({','.join(names)})"
    return [(label, names, list(range(len(prompt_ids))))]


def mean_logprob(values: list[np.ndarray]) -> np.ndarray:
    """log of the mean of exp(values) over the list (one array: itself), in float64, as float32."""
    if len(values) == 1:
        return values[0]
    stacked = np.stack([np.asarray(v, np.float64) for v in values])
    return (np.logaddexp.reduce(stacked, axis=0) - np.log(len(values))).astype(np.float32)


def context_prompts(context: TeacherPrompts | None, rows: UnitRows) -> list[list[int]] | None:
    """Per row, the prompt ids the teacher reads in place of the student's; None without a context."""
    if context is None:
        return None
    return [context.token_ids(context.by_id[pid]) for pid in rows.prompt_ids]
