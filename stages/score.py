"""Score: the teacher's and the (recomputed) student's log-prob of every sampled token.

One score unit per rollout unit, read top to bottom in :meth:`ScoreJob.run_unit`:

1. the unit's rollouts, their token ids flat (:class:`gndpo.stages.scoring.forward.UnitRows`);
2. the student's and the teacher's per-token columns, from the teacher backend ``score.backend`` names
   (:mod:`gndpo.stages.teachers`: HF teacher modules beside the student's forward, a vLLM engine,
   servers, or a teacher with its own tokenizer over any of them). The student's log-probs use the sampling temperature,
   the teacher's temperature 1; the student's forward is the same function train differentiates, so
   the importance ratio at a round's first step is 1 up to float error. Besides the sampled tokens'
   log-probs, the run's method may need the teacher's top-k with the log of its mass outside it,
   entropies, or the full-vocabulary KL (:func:`gndpo.pipeline.methods.score_needs`);
3. the shard (:mod:`gndpo.stages.scoring.shard`): non-finite values refused, the columns rounded to
   ``score.dtype``, and each row's partial sums of the clamped score c_t that normalize aggregates.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from gndpo.pipeline.config.checks import engine_logprob_blockers
from gndpo.pipeline.exec.inputs import Read
from gndpo.pipeline.exec.stage import Launch, StageContext, StageJob
from gndpo.pipeline.methods import score_needs
from gndpo.pipeline.methods.base import TOPK
from gndpo.pipeline.run.products import ROLLOUTS, SCORES, HeldoutFigures, ScoreNumbers
from gndpo.pipeline.run.run import Run
from gndpo.stages.models.device import local_device, set_cpu_threads
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.loading import check_same_tokenizer, vocabulary_size
from gndpo.stages.models.vision import BatchImages
from gndpo.stages.scoring.forward import UnitRows
from gndpo.stages.scoring.shard import refuse_non_finite, score_shard
from gndpo.stages.teachers.base import TeacherBackend
from gndpo.stages.teachers.registry import build_teacher
from gndpo.stages.teachers.setup import ScoreSetup
from gndpo.storage.products import Commit, FileKind, FileRecord, Unit
from gndpo.storage.shards import read_shard, write_shard


class ScoreJob(StageJob):
    """The score stage: each unit scores a committed rollout shard's responses with every teacher (and
    the student's recomputed log-probs where the method needs them) and writes one score shard."""

    makes = SCORES
    # Unit u scores rollout's unit u, once that one is committed: with ``follow`` (the context's), while
    # rollout still runs; otherwise rollout must be committed first.
    reads = (Read(ROLLOUTS, per_unit=True),)
    launch = Launch(per_gpu=True)

    def __init__(self, run: Run, round_idx: int, context: StageContext | None = None):
        super().__init__(run, round_idx, context)
        self.live = self.context.live or LiveModels()
        self.backend: TeacherBackend | None = None  # the teacher backend, once setup made it

    def plan(self):
        """One unit per rollout unit of rollout's plan (the evaluation unit's excepted), plus the
        evaluation unit where rollout samples held-out responses for the label-free held-out measure
        (prompts without answers). Rollout's plan is enough: a unit's rollout files are read when it
        runs, so the plan is the same whether rollout has committed or is still running."""
        waiting = lambda: self.log(f"score r{self.round}: waiting for rollout of round {self.round} to plan its units")  # noqa: E731
        rollout_units = self.inputs.plan_units(ROLLOUTS, on_wait=waiting)
        units = [Unit(u.id) for u in rollout_units if u.is_work]
        # Rollout's held-out responses: scored where they are rollout rows (prompts without answers).
        if self.run.heldout_measure() == "label_free":
            units += [u for u in rollout_units if not u.is_work]
        extras = sorted(score_needs(self.cfg.method))
        teacher = self.cfg.teachers or self.cfg.teacher
        return units, {"rollout_round": self.round, "teacher": teacher, "extras": extras}

    def rollout_files(self, unit: Unit) -> list[FileRecord]:
        """The rollout files ``unit`` scores: its rollout unit's shard, or for the held-out evaluation the
        held-out responses (not the accuracy table)."""
        files = self.inputs.unit_commit(ROLLOUTS, unit.id).files
        if not unit.is_work:
            return [f for f in files if f.kind is FileKind.HELDOUT_ROLLOUTS]
        return files

    def setup(self):
        """The student module and the teacher backend that scores beside it."""
        set_cpu_threads()
        # The policy that sampled the round (older than the round's own with run.max_staleness): the
        # student's column is the behaviour's log-probs, which train's importance ratio divides by.
        policy = self.run.policy_path(self.run.sampling_version(self.round))
        # The teachers of this round: a self-teacher's weights may follow the student (live, ema).
        teachers = self.run.teacher_models(self.round)
        if not self.cfg.score.cross_tokenizer:
            for path in teachers.values():
                check_same_tokenizer(policy, path)
        device = local_device()
        # A run whose prompts show pictures: the student's image tensors, and the pictures by prompt.
        images = BatchImages.of_run(self.run, self.run.policy_path(0))
        self.live.release_engine()
        # The rollout engine's log-probs may stand in for the student's forward (score.student_logprobs).
        self.from_engine = self.student_from_engine()
        student = None if self.from_engine else self.live.causal_lm(policy, self.cfg.model, device, fixed=False, base=self.run.lora_base())
        # At most the smallest teacher vocabulary (teachers of other tokenizers differ): the HF backend's
        # torch.topk and vLLM both stop there, and a shard's top-k has one width.
        smallest = min(vocabulary_size(p) for p in teachers.values())
        self.topk = min(self.cfg.score.teacher_topk, smallest) if TOPK in score_needs(self.cfg.method) else 0
        setup = ScoreSetup(self.run, self.live, device, policy, student, images)
        self.teacher, self.backend = build_teacher(setup, teachers)

    def student_from_engine(self) -> bool:
        """Whether the student's column is the rollout engine's sampler log-probs: score.student_logprobs
        engine, or auto where every rollout worker's engine sampled in fp32 (engine and trainer agree to
        about 1e-6 there), nothing rules the sampler's numbers out (init refused those cases for engine),
        and no student metric needs the forward anyway (logging.entropy_metrics: the student's entropy)."""
        mode = self.cfg.score.student_logprobs
        if mode != "auto":
            return mode == "engine"
        # The rollout units committed so far (at least the one this worker claimed): a stage streaming
        # behind rollout decides before the rest exist; every worker of a node samples in one precision.
        commits = self.inputs.committed_units(ROLLOUTS)
        bits = min((c.numbers.engine_dtype_bits for c in commits if c.numbers.engine_dtype_bits is not None), default=None)
        return bits == 32 and not engine_logprob_blockers(self.cfg) and not self.cfg.logging.entropy_metrics

    @torch.no_grad()
    def run_unit(self, unit, out_dir):
        """Every teacher's (and, where the method needs it, the student's) per-token values for the
        rollout shard's responses, refused if any is not finite, as one score shard."""
        if not unit.is_work:
            return [], ScoreNumbers(eval=self.heldout_measure(self.rollout_files(unit)))
        rows = UnitRows.read(self.run.fs, self.rollout_files(unit))
        before = self.backend.counts()
        scored = self.teacher.score(rows, self.topk)
        refuse_non_finite(scored.per_token, rows, self.round)
        table, counts = score_shard(rows, scored, self.cfg, self.from_engine)
        counts.update({key: value - before[key] for key, value in self.backend.counts().items()})
        record = write_shard(self.run.fs, f"{out_dir}/part-00000.parquet", table)
        return [record], ScoreNumbers(**counts)

    def live_state(self) -> dict:
        """What `gndpo status` shows of this worker while it holds a unit: its teacher's state (each
        teacher server's), once setup has made it."""
        return self.backend.live_state() if self.backend is not None else {}

    def heldout_measure(self, files: list[FileRecord]) -> HeldoutFigures:
        """The label-free held-out measure of the round's policy (prompts without answers): the
        reverse-KL estimate, mean over the sampled responses' tokens of student minus teacher log-prob,
        and the teacher's mean log-prob per token of the greedy responses (rollout's held-out rows:
        sample 0 greedy, 1 sampled)."""
        table = pa.concat_tables([read_shard(self.run.fs, f) for f in files])
        # One temperature per scored unit: the greedy rows are read at the sampled rows' (only the
        # teacher's column of them is used, at temperature 1 like every teacher's).
        column = table.schema.get_field_index("temperature")
        table = table.set_column(column, "temperature", pa.array([self.cfg.rollout.temperature] * table.num_rows, pa.float64()))
        rows = UnitRows.of_table(table)
        per_token = self.teacher.score(rows, 0).per_token
        sample_of_row = table.column("sample_idx").to_numpy()
        sample = np.repeat(sample_of_row, rows.lengths)
        sampled = rows.loss_masks.astype(bool)
        teacher, student = per_token["teacher_logprobs"].astype(np.float64), per_token["student_logprobs"].astype(np.float64)
        greedy, drawn = sampled & (sample == 0), sampled & (sample == 1)
        return HeldoutFigures(reverse_kl=float(np.mean(student[drawn] - teacher[drawn])) if drawn.any() else None,
                              teacher_logprob=float(np.mean(teacher[greedy])) if greedy.any() else None,
                              prompts=int((sample_of_row == 0).sum()))

    def summarize(self, commits: list[Commit[ScoreNumbers]]) -> dict:
        """The manifest's metrics: tokens, speed, and the student's columns against the sampler's."""
        heldout = [c.numbers.eval for c in commits if not c.is_work]
        units = [c.numbers for c in commits if c.is_work]  # each scoring unit's own numbers
        total = lambda field: sum(getattr(u, field) or 0 for u in units)  # noqa: E731
        seconds, student_tokens = total("seconds"), total("student_tokens")
        metrics = {"tokens": total("tokens"), "seconds": seconds, "tokens_per_s": total("tokens") / max(seconds, 1e-9)}
        # 1: the student's column is the rollout engine's sampler log-probs (score.student_logprobs).
        metrics["student_logprobs_from_engine"] = int(max((u.student_from_engine for u in units), default=0))
        # Named after verl's actor/entropy and training/rollout_probs_diff_{max,mean} (in log-probs here).
        if all(u.student_entropy_sum is not None for u in units):
            metrics["student_entropy_mean"] = total("student_entropy_sum") / max(student_tokens, 1)
        if all(u.teacher_entropy_sum is not None for u in units):
            metrics["teacher_entropy_mean"] = total("teacher_entropy_sum") / max(student_tokens, 1)
        if all(u.logprob_diff_sum is not None for u in units):
            metrics["rollout_logprob_diff_max"] = max(u.logprob_diff_max for u in units)
            metrics["rollout_logprob_diff_mean"] = total("logprob_diff_sum") / max(student_tokens, 1)
        if self.cfg.score.cross_tokenizer:
            unaligned = int(total("unaligned_tokens"))
            metrics["cross_tokenizer/unaligned_tokens"] = unaligned
            metrics["cross_tokenizer/unaligned_fraction"] = unaligned / max(unaligned + metrics["tokens"], 1)
            # Tokens whose teacher value is a share of a span of several student tokens (stages/text/align.py).
            metrics["cross_tokenizer/split_span_fraction"] = total("split_span_tokens") / max(metrics["tokens"], 1)
        if any(u.server_retries is not None for u in units):  # score.backend server: what the servers' failures cost
            metrics["server_retries"] = int(total("server_retries"))
            metrics["server_cooldowns"] = int(total("server_cooldowns"))
        for figures in heldout:  # the label-free held-out measure of the round's policy (rollout's prompts)
            metrics.update({"heldout_reverse_kl": figures.reverse_kl, "heldout_teacher_logprob": figures.teacher_logprob})
        return metrics
