"""What each stage of a round hands the next, as types: the product a stage commits (its name and the
type of its units' numbers) and those numbers, field by field.

A round makes four products, in this order (:data:`ROUND`): the rollouts, their scores, the round's
statistics and the next policy. A stage class says which product it makes (``makes``) and which it
reads (:class:`gndpo.pipeline.exec.inputs.Read`); the executor, the run and the tools reach another
stage's output through these declarations, never by a stage's name. The numbers are what a unit's
commit record carries besides its files (:class:`gndpo.storage.products.UnitNumbers`: the executor's
``seconds``, ``worker`` and ``phases``); each stage's manifest metrics are summed from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic

from pydantic import BaseModel, ConfigDict

from gndpo.storage.products import FileRecord, Manifest, N, UnitNumbers
from gndpo.storage.records import StageRecords


class HeldoutFigures(BaseModel):
    """A held-out evaluation's figures: the greedy responses' ``accuracy`` over ``n`` prompts with
    answers; without answers, rollout marks its responses ``label_free`` and score measures them (the
    ``reverse_kl`` estimate on sampled responses, the teacher's mean ``teacher_logprob`` of the greedy
    ones, over ``prompts``)."""

    model_config = ConfigDict(extra="allow")

    accuracy: float | None = None
    n: int | None = None
    label_free: bool = False
    reverse_kl: float | None = None
    teacher_logprob: float | None = None
    prompts: int | None = None


class RolloutNumbers(UnitNumbers):
    """A rollout unit's numbers: what it sampled, the sampler's precision and (vLLM) its probe of the
    exported weights, the unit's tool use; or, for the held-out evaluation, its figures (``eval``)."""

    prompts: int = 0
    responses: int = 0
    tokens: int = 0
    reward_sum: float | None = None  # None: the run's reward reads answers the prompts do not have
    engine_dtype_bits: int | None = None
    # The sampling engine against the exported model (gndpo.stages.models.probe), where measured.
    engine_probe_gap_max: float | None = None
    engine_probe_gap_mean: float | None = None
    engine_reloaded: int | None = None
    engine_restarted: int | None = None
    engine_adapters: int | None = None
    # Conversations (gndpo.stages.text.agent.conversation_counts).
    llm_tokens: int = 0
    tool_tokens: int = 0
    turns_sum: int = 0
    turns_min: int = 0
    turns_max: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    eval: HeldoutFigures | None = None


class ScoreNumbers(UnitNumbers):
    """A score unit's numbers: the tokens it scored, where the student's column came from, the sums
    the manifest's entropy and sampler-gap metrics divide, a cross-tokenizer teacher's unaligned and
    split tokens, a served teacher's retries; or the held-out measure (``eval``)."""

    tokens: int = 0
    student_tokens: int = 0
    student_from_engine: int = 0
    student_entropy_sum: float | None = None
    teacher_entropy_sum: float | None = None
    logprob_diff_sum: float | None = None
    logprob_diff_max: float | None = None
    unaligned_tokens: int | None = None
    split_span_tokens: int | None = None
    server_retries: int | None = None
    server_cooldowns: int | None = None
    eval: HeldoutFigures | None = None


class StatsNumbers(UnitNumbers):
    """The statistics unit's numbers: the round's global statistics by name, and how many scopes
    (prompts, teachers) have their own."""

    stats: dict[str, float | None] = {}
    groups: int = 0


class CarriedState(BaseModel):
    """An optimizer state a train stage carried to the next round: the engine state's files as written
    by ``world`` ranks; or, written after the commit (``train.state_async``), only the run-relative
    path of the record that will hold them (``pending``)."""

    model_config = ConfigDict(extra="allow")

    world: int = 1
    files: list[dict] | None = None  # None: not written yet (``pending``)
    pending: str | None = None

    def file_records(self) -> list[FileRecord]:
        return [FileRecord.of(f) for f in self.files or []]

    def to_json(self) -> dict:
        return self.model_dump(mode="json", exclude_unset=True)


@dataclass(frozen=True)
class PolicyExport:
    """A trained policy where its train stage committed it: the model's folder, its EMA average's
    (``self_teacher.weights: ema``), and the model's files, relative to the run that holds them."""

    model_dir: str
    ema_dir: str | None
    files: list[FileRecord]


class TrainNumbers(UnitNumbers):
    """The update's numbers: every optimizer step's figures, what it trained on and where it started,
    the policy it exported (``model_dir``, ``ema_dir``) and the optimizer state it carried."""

    steps: list[dict] = []
    responses: int = 0
    tokens: int = 0
    adv_min: float | None = None
    adv_max: float | None = None
    adv_mean: float | None = None
    adv_std: float | None = None
    divergence: str | None = None
    model_dir: str = ""
    ema_dir: str | None = None
    optimizer_state: CarriedState | None = None
    optimizer_state_resumed: bool = False
    resumed_after_step: int = 0


@dataclass(frozen=True)
class Product(Generic[N]):
    """What one stage commits each round: the stage's name (its folder under the round) and the type
    its units' numbers read as."""

    stage: str
    numbers: type[N]


ROLLOUTS = Product("rollout", RolloutNumbers)
SCORES = Product("score", ScoreNumbers)
STATISTICS = Product("normalize", StatsNumbers)
POLICY = Product("train", TrainNumbers)
# A round's products in the order its stages make them.
ROUND: tuple[Product, ...] = (ROLLOUTS, SCORES, STATISTICS, POLICY)


def policy_export(manifest: Manifest[TrainNumbers]) -> PolicyExport:
    """The policy a committed train stage exported."""
    update = manifest.only().numbers
    return PolicyExport(update.model_dir, update.ema_dir, [f for f in manifest.files() if f.under(update.model_dir)])


def carried_state(records: StageRecords[TrainNumbers]) -> CarriedState | None:
    """The optimizer state a committed train stage carried to the next round: the one its commit lists,
    or the record it names as written after it (``pending``, train.state_async); None where it wrote
    none, or the named record never appeared (the writing process died first)."""
    state = records.require_manifest().only().numbers.optimizer_state
    if state is not None and state.pending is not None:
        written = records.run.read_json_or_none(state.pending)
        state = None if written is None else CarriedState.model_validate(written)
    return state if state is not None and state.files is not None else None
