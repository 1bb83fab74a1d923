"""Score: the teacher's and the (recomputed) student's log-prob of every sampled token.

One score unit per rollout unit. Responses are grouped by length into batches of at most
``score.max_tokens_per_batch`` padded tokens; each batch runs both backbones once and then the output
layers over a chunk of response positions at a time, sized by ``model.logits_budget_mib`` (at most
``model.token_chunk``; :mod:`gndpo.stages.models.logprobs`), so full-vocabulary logits exist for one chunk
only and never for prompt positions. The student's log-probs use the sampling temperature, the
teacher's temperature 1 (the same function train differentiates, so the importance ratio at a round's
first step is 1 up to float error). Each row also carries the partial sums of the clamped score c_t
that normalize aggregates, and the optional per-token columns the run's method needs (teacher top-k
with the log of the teacher's mass outside it, entropies, full-vocabulary KL). Non-finite values are
refused: a NaN here would silently poison the round's global statistics.

With ``score.backend: vllm`` the teacher's sampled-token and top-k log-probs come from a vLLM engine
instead (prompt log-probs over the stored ids, :func:`gndpo.stages.models.vllm_engine.response_logprobs`; tensor
parallel through ``score.engine``), while the student's are still computed here by the same forward
train differentiates, so the first step's importance ratio stays exactly 1. Methods that need the
teacher's whole distribution (its entropy, the full KL) are refused with this backend, and the
teacher's rest mass beside its top-k is 1 - sum(top-k p) (vLLM returns no more), computed in float64
but only as exact as the top-k values: noise for a teacher whose true rest is below ~1e-7.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.methods.losses import REST_MASS_FLOOR
from gndpo.pipeline.methods import clamped_score, score_needs, score_partial_sums
from gndpo.pipeline.methods.base import STUDENT_ENTROPY, TEACHER_ENTROPY, TOKEN_KL, TOPK
from gndpo.pipeline.run.run import Run
from gndpo.stages.text.cross_tokenizer import CrossTokenizerTeacher
from gndpo.stages.models.device import local_device, set_cpu_threads
from gndpo.stages.models.vllm_engine import response_logprobs, vocabulary_size
from gndpo.stages.models.logprobs import logits_chunk, make_batch, pair_token_stats, token_budget_batches
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.loading import check_same_tokenizer, load_tokenizer
from gndpo.stages.text.teacher_context import TeacherPrompts
from gndpo.storage.records import EVAL_UNIT
from gndpo.storage.shards import flat_values, list_column, read_shard, round_to_bfloat16, scores_schema, write_shard
from gndpo.pipeline.observe.logs import info

class ScoreJob:
    stage = "score"

    def __init__(self, run: Run, round_idx: int, log=info, live: LiveModels | None = None):
        self.run, self.round, self.cfg, self.log = run, round_idx, run.cfg, log
        self.live = live or LiveModels()

    def plan(self):
        rollouts = self.run.records(self.round, "rollout").require_manifest()
        units = [
            {"unit": u["unit"], "rollout_files": u["files"]} for u in rollouts["units"] if u["unit"] != EVAL_UNIT
        ]
        extras = sorted(score_needs(self.cfg.method))
        teacher = self.cfg.teachers or self.cfg.teacher
        return units, {"rollout_manifest_finished_at": rollouts["finished_at"], "teacher": teacher, "extras": extras}

    def setup(self):
        set_cpu_threads()
        policy = self.run.policy_path(self.round)
        # The teachers of this round: a self-teacher's weights may follow the student (live, ema).
        self.models = models = self.run.teacher_models(self.round)
        fixed = not self.run.teacher_changes()
        if not self.cfg.score.cross_tokenizer:
            for path in models.values():
                check_same_tokenizer(policy, path)
        self.pad_id = load_tokenizer(policy).pad_token_id or 0
        self.device = local_device()
        self.live.release_engine()
        self.student = self.live.causal_lm(policy, self.cfg.model, self.device, fixed=False)
        self.teachers, self.teacher_engine, self.cross = {}, None, None
        if self.cfg.score.cross_tokenizer:  # the student pass runs alone; the teacher scores its own tokens
            sc = self.cfg.score
            path = next(iter(models.values()))
            teacher = self.live.causal_lm(path, self.cfg.model, self.device, fixed=True)
            self.cross = CrossTokenizerTeacher(
                teacher, self._teacher_prompts(path), load_tokenizer(policy), self.device,
                logits_chunk(teacher, self.cfg.model), sc.max_tokens_per_batch, sc.rows_per_chunk,
            )
        elif self.cfg.score.backend == "vllm":
            self.teacher_engine = self.live.teacher_engine(next(iter(models.values())), self.cfg.score.engine, self.cfg.score.teacher_topk)
        else:
            # A live self-teacher is the round's policy: the student module scores as both.
            self.teachers = {name: self.student if path == policy else self.live.causal_lm(path, self.cfg.model, self.device, fixed=fixed)
                             for name, path in models.items()}
        # With a teacher context the teacher reads its own prompt before the same response ids.
        self.teacher_prompts = self._teacher_prompts(next(iter(models.values()))) if self.cfg.teacher_context.messages else None
        self.routes = {}
        if self.cfg.teachers and self.cfg.score.teacher_mix == "route":
            self.routes = {p["prompt_id"]: p["teacher"] for p in self.run.prompts("train")}

    def _teacher_prompts(self, teacher_path: str) -> TeacherPrompts:
        return TeacherPrompts(load_tokenizer(teacher_path), self.cfg.data, self.cfg.teacher_context, self.run.prompts("train"))

    def teacher_groups(self, prompt_ids: list[str]) -> dict[str, tuple[object, list[int]]]:
        """{label recorded per row: (the teacher module(s) that score those rows, the rows)}: each row's
        routed teacher, or all rows to the one teacher (a list of modules for the mean mix)."""
        if self.routes:
            groups: dict[str, tuple[object, list[int]]] = {}
            for i, pid in enumerate(prompt_ids):
                name = self.routes[pid]
                groups.setdefault(name, (self.teachers[name], []))[1].append(i)
            return groups
        rows = list(range(len(prompt_ids)))
        if len(self.teachers) > 1:  # score.teacher_mix mean
            return {f"mean({','.join(self.teachers)})": (list(self.teachers.values()), rows)}
        return {next(iter(self.models)): (next(iter(self.teachers.values()), None), rows)}

    @torch.no_grad()
    def run_unit(self, unit, out_dir):
        sc, needs = self.cfg.score, score_needs(self.cfg.method)
        table = pa.concat_tables([read_shard(self.run.fs, f) for f in unit["rollout_files"]])
        prompts, prompt_offsets = flat_values(table.column("prompt_token_ids"))
        responses, offsets = flat_values(table.column("response_token_ids"))
        lengths = np.diff(offsets)
        temps = table.column("temperature").to_pylist()
        temperature = temps[0] if temps else 1.0
        # At most the vocabulary: the HF backend's torch.topk and vLLM both stop there.
        first_teacher = next(iter(self.models.values()))
        topk = min(sc.teacher_topk, vocabulary_size(first_teacher)) if TOPK in needs else 0
        per_token: dict[str, np.ndarray] = {}
        labels = [""] * table.num_rows
        teacher_prompts = None  # per row, where the teacher reads a context of its own
        if self.teacher_prompts is not None:
            by_id = {p["prompt_id"]: p for p in self.run.prompts("train")}
            teacher_prompts = [self.teacher_prompts.token_ids(by_id[pid]) for pid in table.column("prompt_id").to_pylist()]
        for label, (teacher, members) in self.teacher_groups(table.column("prompt_id").to_pylist()).items():
            members = np.asarray(members)
            for i in members:
                labels[i] = label
            spans = (np.diff(prompt_offsets) + lengths)[members]
            for batch_rows in token_budget_batches(spans, sc.max_tokens_per_batch, sc.rows_per_chunk):
                rows = members[batch_rows]
                batch = make_batch(
                    [prompts[prompt_offsets[i] : prompt_offsets[i + 1]] for i in rows],
                    [responses[offsets[i] : offsets[i + 1]] for i in rows], self.pad_id, self.device,
                )
                teacher_batch = None if teacher_prompts is None or teacher is None else make_batch(
                    [teacher_prompts[i] for i in rows], [responses[offsets[i] : offsets[i + 1]] for i in rows], self.pad_id, self.device,
                )
                # The round's entropy metrics need both entropies even where the method stores no
                # entropy column (logging.entropy_metrics: one more pass over each chunk's log-probs).
                metric = self.cfg.logging.entropy_metrics
                stats = pair_token_stats(
                    teacher, self.student, batch, logits_chunk([self.student, *self.teachers.values()], self.cfg.model), temperature, topk,
                    ((metric and teacher is not None) or TEACHER_ENTROPY in needs, metric or STUDENT_ENTROPY in needs), TOKEN_KL in needs,
                    teacher_batch=teacher_batch,
                )
                # Put the batch's tokens back at their rows' places in the unit's flat token order.
                where = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in rows] + [np.zeros(0, np.int64)])
                for name, values in stats.items():
                    values = values.float().numpy() if values.is_floating_point() else values.numpy()
                    if name not in per_token:
                        per_token[name] = np.zeros((len(responses), *values.shape[1:]), dtype=values.dtype)
                    per_token[name][where] = values
        if self.teacher_engine is not None:  # the teacher's columns, from its engine, in the same token order
            by_engine = response_logprobs(
                self.teacher_engine, teacher_prompts or [prompts[prompt_offsets[i] : prompt_offsets[i + 1]] for i in range(len(lengths))],
                [responses[offsets[i] : offsets[i + 1]] for i in range(len(lengths))], topk,
            )
            per_token["teacher_logprobs"] = by_engine["logprobs"]
            if topk:
                per_token["teacher_topk_ids"], per_token["teacher_topk_logprobs"] = by_engine["topk_ids"], by_engine["topk_logprobs"]
                per_token["teacher_rest_logprob"] = rest_logprob_from_topk(by_engine["topk_logprobs"])
        aligned = None
        if self.cross is not None:
            by_id = {p["prompt_id"]: p for p in self.run.prompts("train")}
            per_token["teacher_logprobs"], aligned = self.cross.score(
                [by_id[pid] for pid in table.column("prompt_id").to_pylist()],
                [responses[offsets[i] : offsets[i + 1]] for i in range(len(lengths))], per_token["student_logprobs"],
            )
        self._refuse_non_finite(table, per_token, offsets)
        student_mask, _ = flat_values(table.column("loss_mask"))
        # vLLM's sampler log-probs are of the raw distribution: comparable with ours at temperature 1 only.
        sampler = flat_values(table.column("sampler_logprobs"))[0] if temperature == 1.0 else None
        counts = token_metric_sums(per_token, sampler, student_mask > 0)
        for name in (TEACHER_ENTROPY, STUDENT_ENTROPY):  # written as columns only for the methods that use them
            if name not in needs:
                per_token.pop(name, None)
        if sc.dtype == "bfloat16":
            # Rounded before anything is derived from them, so the row sums below, normalize's token
            # statistics and train's old log-probs all see the stored values.
            # The teacher's rest log-prob stays float32: it is kept because it is exact where the
            # top-k values cannot give it (a rest of 1e-9 next to bf16 top-k mass is all rounding).
            per_token = {k: round_to_bfloat16(v) if v.dtype == np.float32 and k != "teacher_rest_logprob" else v for k, v in per_token.items()}
        c = clamped_score(per_token["teacher_logprobs"], per_token["student_logprobs"], self.cfg.method.clamp)
        masks = student_mask
        if aligned is not None:  # unaligned student tokens count nowhere
            masks = masks * aligned
            per_token["aligned"] = aligned
        partial = [score_partial_sums(c[offsets[i] : offsets[i + 1]], masks[offsets[i] : offsets[i + 1]].astype(np.float64)) for i in range(len(lengths))]
        k = per_token["teacher_topk_ids"].shape[1] if "teacher_topk_ids" in per_token else sc.teacher_topk
        schema = scores_schema(k)
        columns = {
            "rollout_id": table.column("rollout_id"),
            "prompt_id": table.column("prompt_id"),
            "teacher": pa.array(labels, pa.string()),
        }
        for name in schema.names:
            if name in columns:
                continue
            typ = schema.field(name).type
            if name in per_token:
                columns[name] = list_column(per_token[name], lengths, typ)
            elif pa.types.is_list(typ):
                columns[name] = pa.nulls(table.num_rows, typ)
            else:
                columns[name] = pa.array([p[name] for p in partial], typ)
        record = write_shard(self.run.fs, f"{out_dir}/part-00000.parquet", pa.table(columns, schema=schema))
        counts["tokens"] = int(sum(p["n_valid"] for p in partial))
        if aligned is not None:
            counts["unaligned_tokens"] = int(len(aligned) - aligned.sum())
        return [record], counts

    def _refuse_non_finite(self, table, per_token: dict, offsets: np.ndarray) -> None:
        for name, values in per_token.items():
            if values.dtype.kind != "f":
                continue
            bad = ~np.isfinite(values.reshape(len(values), -1)).all(-1)
            if bad.any():
                row = int(np.searchsorted(offsets, np.argmax(bad), side="right") - 1)
                rid = table.column("rollout_id")[row].as_py()
                raise GndpoError(f"non-finite {name} for rollout {rid} in round {self.round}; refusing to score")

    def summarize(self, commits):
        total = lambda key: sum(c.get(key, 0.0) for c in commits)  # noqa: E731
        seconds, student_tokens = total("seconds"), total("student_tokens")
        metrics = {"tokens": total("tokens"), "seconds": seconds, "tokens_per_s": total("tokens") / max(seconds, 1e-9)}
        # Named after verl's actor/entropy and training/rollout_probs_diff_{max,mean} (in log-probs here).
        if all("student_entropy_sum" in c for c in commits):
            metrics["student_entropy_mean"] = total("student_entropy_sum") / max(student_tokens, 1)
        if all("teacher_entropy_sum" in c for c in commits):
            metrics["teacher_entropy_mean"] = total("teacher_entropy_sum") / max(student_tokens, 1)
        if all("logprob_diff_sum" in c for c in commits):
            metrics["rollout_logprob_diff_max"] = max(c["logprob_diff_max"] for c in commits)
            metrics["rollout_logprob_diff_mean"] = total("logprob_diff_sum") / max(student_tokens, 1)
        if self.cfg.score.cross_tokenizer:
            unaligned = sum(c["unaligned_tokens"] for c in commits)
            metrics["cross_tokenizer/unaligned_tokens"] = unaligned
            metrics["cross_tokenizer/unaligned_fraction"] = unaligned / max(unaligned + metrics["tokens"], 1)
        return metrics


def rest_logprob_from_topk(topk_logprobs: np.ndarray) -> np.ndarray:
    """[N, k] top-k log-probs -> [N] float32 log(1 - sum_k p), the teacher's rest mass where only its
    top-k is known (score.backend vllm): computed in float64 as log(-expm1(logsumexp)), with the mass
    floored at REST_MASS_FLOOR as train's own recomputation does. Exact only to the top-k's rounding:
    a true rest below ~1e-7 comes out as noise (the HF backend stores the full softmax's instead)."""
    lse = np.logaddexp.reduce(np.asarray(topk_logprobs, dtype=np.float64), axis=-1)
    return np.log(np.maximum(-np.expm1(lse), REST_MASS_FLOOR)).astype(np.float32)


def token_metric_sums(per_token: dict, sampler_logprobs: np.ndarray | None, student_tokens: np.ndarray) -> dict:
    """A unit's sums behind the round's score metrics, over the tokens the student sampled: both models'
    entropies (where computed) and, given the sampler's log-probs, |student log-prob recomputed here -
    the sampler's|, the gap between the rollout engine's and the training forward's numbers for the
    same policy."""
    sums = {"student_tokens": int(student_tokens.sum())}
    if sampler_logprobs is not None:
        diff = np.abs(per_token["student_logprobs"][student_tokens].astype(np.float64) - sampler_logprobs[student_tokens])
        sums.update({"logprob_diff_max": float(diff.max(initial=0.0)), "logprob_diff_sum": float(diff.sum())})
    for name in (STUDENT_ENTROPY, TEACHER_ENTROPY):
        if name in per_token:
            sums[f"{name}_sum"] = float(per_token[name][student_tokens].astype(np.float64).sum())
    return sums
