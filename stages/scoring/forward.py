"""A score unit's rows, and the student's forward over them (with a teacher module beside it, if any).

Rows are grouped by length into batches of at most ``score.max_tokens_per_batch`` padded tokens; each
batch runs the backbones once and then the output layers over a chunk of response positions at a time
(:func:`gndpo.stages.models.logprobs.pair_token_stats`), so full-vocabulary logits exist for one chunk
only and never for prompt positions. Every column comes back flat over the unit's response tokens, in
the rollout shard's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import torch

from gndpo.pipeline.methods.base import STUDENT_ENTROPY, TEACHER_ENTROPY, TOKEN_KL
from gndpo.pipeline.observe import progress
from gndpo.stages.models.batches import TokenBatch, make_batch, token_budget_batches
from gndpo.stages.models.logprobs import pair_token_stats
from gndpo.stages.models.vision import BatchImages
from gndpo.storage.products import FileRecord
from gndpo.storage.shards import flat_values, read_shard


@dataclass
class Scored:
    """A unit's per-token columns, the student's and the teacher's, flat over its response tokens; the
    teacher recorded per row; and, for a cross-tokenizer teacher, 1 where a student token has a teacher
    value (``aligned``; None: every token counts) and 1 where that value is a share of a span of several
    student tokens (``split``; :mod:`gndpo.stages.text.align`)."""

    per_token: dict[str, np.ndarray]
    labels: list[str]
    aligned: np.ndarray | None = None
    split: np.ndarray | None = None


@dataclass
class UnitRows:
    """A score unit's rollouts, their token ids flat: row i's prompt is
    ``prompts[prompt_offsets[i]:prompt_offsets[i + 1]]``, its response ``responses[offsets[i]:offsets[i + 1]]``."""

    table: pa.Table
    prompts: np.ndarray
    prompt_offsets: np.ndarray
    responses: np.ndarray
    offsets: np.ndarray

    @classmethod
    def read(cls, fs, files: list[FileRecord]) -> UnitRows:
        return cls.of_table(pa.concat_tables([read_shard(fs, f) for f in files]))

    @classmethod
    def of_table(cls, table: pa.Table) -> UnitRows:
        prompts, prompt_offsets = flat_values(table.column("prompt_token_ids"))
        responses, offsets = flat_values(table.column("response_token_ids"))
        return cls(table, prompts, prompt_offsets, responses, offsets)

    @property
    def n(self) -> int:
        return self.table.num_rows

    @property
    def lengths(self) -> np.ndarray:
        """Response tokens per row."""
        return np.diff(self.offsets)

    @property
    def sampler_logprobs(self) -> np.ndarray:
        """The rollout engine's log-prob of each response token (temperature 1), flat, float32."""
        return flat_values(self.table.column("sampler_logprobs"))[0].astype(np.float32)

    @property
    def spans(self) -> np.ndarray:
        """Prompt + response tokens per row: what a row costs in a padded batch."""
        return np.diff(self.prompt_offsets) + self.lengths

    @cached_property
    def prompt_ids(self) -> list[str]:
        return self.table.column("prompt_id").to_pylist()

    @cached_property
    def temperature(self) -> float:
        """The unit's sampling temperature (one per run)."""
        temps = self.table.column("temperature").to_pylist()
        return temps[0] if temps else 1.0

    def prompt(self, i: int) -> np.ndarray:
        return self.prompts[self.prompt_offsets[i] : self.prompt_offsets[i + 1]]

    def response(self, i: int) -> np.ndarray:
        return self.responses[self.offsets[i] : self.offsets[i + 1]]

    @cached_property
    def loss_masks(self) -> np.ndarray:
        """Every response token's loss mask, flat (1: sampled by the student and trained)."""
        return flat_values(self.table.column("loss_mask"))[0]

    def loss_mask(self, i: int) -> np.ndarray:
        return self.loss_masks[self.offsets[i] : self.offsets[i + 1]]

    def tool_results(self, i: int) -> list[str]:
        """Row ``i``'s executed tool calls' answers, in order (none without tools)."""
        if "tool_calls" not in self.table.column_names:
            return []
        return [call["result"] for call in self.table.column("tool_calls")[i].as_py() or [] if call["result"] is not None]

    def token_positions(self, rows) -> np.ndarray:
        """Where the response tokens of ``rows``, in that order, are in the unit's flat token order."""
        return np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in rows] + [np.zeros(0, np.int64)])


@dataclass
class StudentForward:
    """The student's forward over a unit's rows in token-budgeted batches. A teacher given as a module
    (or a list of modules: their mean) reads the same batches beside it, so both backbones run once per
    batch and the teacher's columns come out of the same pass; without one only the student's do.
    Without a student module (``score.student_logprobs: engine``) the student's log-probs are the
    rollout engine's and only a teacher module runs."""

    student: object | None
    chunk: int  # positions per output-layer chunk, planned over the student and every teacher module
    pad_id: int
    device: torch.device
    max_tokens: int  # score.max_tokens_per_batch
    max_rows: int  # score.rows_per_chunk
    needs: frozenset  # the per-token columns the run's method stores
    entropy_metrics: bool  # logging.entropy_metrics
    images: BatchImages | None = None  # a run whose prompts show pictures: the forward's image tensors
    # ... and the teacher's, where it reads its own prompts (its own processor, or a teacher context)
    teacher_images: BatchImages | None = None
    share_prompts: bool = True  # model.shared_prompts: a batch reads each distinct prompt once

    def columns(self, rows: UnitRows, groups, topk: int, teacher_prompts: list | None = None) -> dict[str, np.ndarray]:
        """{column: values flat over the unit's response tokens}. ``groups``: (teacher module(s) or None,
        the rows it scores) covering every row once; ``teacher_prompts``: per row, the prompt the teacher
        reads instead of the student's (a teacher context), or None."""
        per_token: dict[str, np.ndarray] = {}
        # A unit's forward passes can take minutes: its own progress moves batch by batch.
        with progress.task("score: forward passes", total=rows.n, unit="responses", transient=True) as bar:
            for teacher, members in groups:
                if teacher is None and self.student is None:  # no module to run for these rows
                    bar.advance(len(members))
                    continue
                members = np.asarray(members)
                keys = [rows.prompt_ids[i] for i in members]
                for batch_rows in token_budget_batches(rows.spans[members], self.max_tokens, self.max_rows, keys):
                    batch = members[batch_rows]
                    stats = self.batch_columns(rows, batch, teacher, topk, teacher_prompts)
                    place(per_token, stats, rows.token_positions(batch), len(rows.responses))
                    bar.advance(len(batch), tokens=int(rows.lengths[batch].sum()))
        if self.student is None:
            per_token["student_logprobs"] = rows.sampler_logprobs
        return per_token

    def batch_columns(self, rows: UnitRows, batch_rows, teacher, topk: int, teacher_prompts: list | None) -> dict[str, torch.Tensor]:
        """One batch's columns ([N] or [N, k] over its response tokens, on the CPU)."""
        responses = [rows.response(i) for i in batch_rows]
        prompt_ids = [rows.prompt_ids[i] for i in batch_rows]
        batch = self.batch([rows.prompt(i) for i in batch_rows], responses, prompt_ids, self.images)
        teacher_batch = None
        if teacher_prompts is not None and teacher is not None:
            reuse = batch if self.teacher_images is self.images else None  # the student's image tensors serve
            teacher_batch = self.batch([teacher_prompts[i] for i in batch_rows], responses, prompt_ids, self.teacher_images, reuse)
        # The round's entropy metrics need both entropies even where the method stores no entropy
        # column (logging.entropy_metrics: one more pass over each chunk's log-probs).
        metric = self.entropy_metrics
        entropies = ((metric and teacher is not None) or TEACHER_ENTROPY in self.needs,
                     (metric or STUDENT_ENTROPY in self.needs) and self.student is not None)
        return pair_token_stats(teacher, self.student, batch, self.chunk, rows.temperature, topk, entropies, TOKEN_KL in self.needs,
                                teacher_batch=teacher_batch)

    def batch(self, prompts: list, responses: list, prompt_ids: list, images: BatchImages | None,
              reuse: TokenBatch | None = None) -> TokenBatch:
        """A forward batch of these rows (``prompt_ids``: their prompts' ids); with ``images``, the
        tensors of its prompts' pictures, taken from ``reuse`` where its prompt rows show the same."""
        # Prompts that show pictures share a prompt row only within one prompt id (its pictures).
        keys = prompt_ids if self.images is not None else None
        batch = make_batch(prompts, responses, self.pad_id, self.device, self.share_prompts, image_keys=keys)
        if reuse is not None and np.array_equal(batch.prefix_rows, reuse.prefix_rows):
            batch.images = reuse.images
        elif images is not None:
            batch.images = images.inputs([prompt_ids[i] for i in batch.prefix_rows], self.device)
        return batch


def place(per_token: dict[str, np.ndarray], stats: dict[str, torch.Tensor | np.ndarray], where: np.ndarray, n_tokens: int) -> None:
    """Put a batch's columns at its tokens' places (``where``) in the unit's flat token order (floats
    as float32)."""
    for name, values in stats.items():
        if isinstance(values, torch.Tensor):  # bfloat16 has no numpy type: through float32
            values = values.float() if values.is_floating_point() else values
        values = np.asarray(values)
        values = values.astype(np.float32, copy=False) if np.issubdtype(values.dtype, np.floating) else values
        if name not in per_token:
            per_token[name] = np.zeros((n_tokens, *values.shape[1:]), dtype=values.dtype)
        per_token[name][where] = values
