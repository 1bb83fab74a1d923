"""Score: the teacher's and the (recomputed) student's log-prob of every sampled token.

One score unit per rollout unit. Both models run the same forward as train (``response_distributions``) in
chunks of ``score.rows_per_chunk`` responses, so only one chunk's logits exist at a time. The student's
log-probs use the sampling temperature, the teacher's temperature 1 (shared/ALGORITHMS.md, notation).
Each row also carries the partial sums of the clamped score c_t that normalize aggregates, and the
optional per-token columns the run's method needs (teacher top-k, entropies, full-vocabulary KL),
computed from the same chunk's full distributions. Non-finite values are refused: a NaN here would
silently poison the round's global statistics.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.methods import clamped_score, score_needs, score_partial_sums
from gndpo.pipeline.methods.base import STUDENT_ENTROPY, TEACHER_ENTROPY, TOKEN_KL, TOPK
from gndpo.pipeline.runs import Run
from gndpo.stages.modeling import check_same_tokenizer, entropy, load_causal_lm, load_tokenizer, response_distributions, set_cpu_threads
from gndpo.stages.rollout import EVAL_UNIT
from gndpo.storage.shards import SCORES, read_shard, write_shard


class ScoreJob:
    stage = "score"

    def __init__(self, run: Run, round_idx: int, log=print):
        self.run, self.round, self.cfg, self.log = run, round_idx, run.cfg, log

    def plan(self):
        rollouts = self.run.records(self.round, "rollout").require_manifest()
        units = [
            {"unit": u["unit"], "rollout_files": u["files"]} for u in rollouts["units"] if u["unit"] != EVAL_UNIT
        ]
        extras = sorted(score_needs(self.cfg.method))
        return units, {"rollout_manifest_finished_at": rollouts["finished_at"], "teacher": self.cfg.teacher, "extras": extras}

    def setup(self):
        set_cpu_threads()
        policy = self.run.policy_path(self.round)
        check_same_tokenizer(policy, self.cfg.teacher)
        self.pad_id = load_tokenizer(policy).pad_token_id or 0
        self.student = load_causal_lm(policy).eval()
        self.teacher = load_causal_lm(self.cfg.teacher).eval()

    @torch.no_grad()
    def run_unit(self, unit, out_dir):
        table = pa.concat_tables([read_shard(self.run.fs, f) for f in unit["rollout_files"]])
        prompts = table.column("prompt_token_ids").to_pylist()
        responses = table.column("response_token_ids").to_pylist()
        masks = table.column("loss_mask").to_pylist()
        temps = table.column("temperature").to_pylist()
        temperature = temps[0] if temps else 1.0
        chunk = self.cfg.score.rows_per_chunk
        needs = score_needs(self.cfg.method)
        rows = []
        for start in range(0, len(responses), chunk):
            sl = slice(start, start + chunk)
            t_all, t_lp, _ = response_distributions(self.teacher, prompts[sl], responses[sl], self.pad_id, 1.0)
            s_all, s_lp, _ = response_distributions(self.student, prompts[sl], responses[sl], self.pad_id, temperature)
            extras = self._extras(needs, t_all, s_all)
            for i, (resp, mask) in enumerate(zip(responses[sl], masks[sl])):
                n = len(resp)
                row = {"teacher_logprobs": t_lp[i, :n].numpy(), "student_logprobs": s_lp[i, :n].numpy()}
                row.update({k: v[i, :n].numpy() for k, v in extras.items()})
                for name, values in row.items():
                    if not np.isfinite(values).all():
                        rid = table.column("rollout_id")[start + i].as_py()
                        raise GndpoError(f"non-finite {name} for rollout {rid} in round {self.round}; refusing to score")
                c = clamped_score(row["teacher_logprobs"], row["student_logprobs"], self.cfg.method.clamp)
                rows.append({**row, **score_partial_sums(c, np.asarray(mask, dtype=np.float64))})
        columns = {
            "rollout_id": table.column("rollout_id"),
            "prompt_id": table.column("prompt_id"),
            "teacher": pa.array([self.cfg.teacher] * len(rows), pa.string()),
        }
        for name in SCORES.names:
            if name not in columns:
                values = [r.get(name) for r in rows]
                columns[name] = pa.array([v.tolist() if isinstance(v, np.ndarray) else v for v in values], SCORES.field(name).type)
        record = write_shard(self.run.fs, f"{out_dir}/part-00000.parquet", pa.table(columns, schema=SCORES))
        return [record], {"tokens": int(sum(r["n_valid"] for r in rows))}

    def _extras(self, needs, t_all, s_all) -> dict:
        """The optional per-token columns of one chunk ([B, Tr] or [B, Tr, k] tensors)."""
        out = {}
        if TOPK in needs:
            k = min(self.cfg.score.teacher_topk, t_all.shape[-1])
            values, ids = t_all.topk(k, dim=-1)
            out["teacher_topk_logprobs"], out["teacher_topk_ids"] = values, ids.int()
        if TEACHER_ENTROPY in needs:
            out["teacher_entropy"] = entropy(t_all)
        if STUDENT_ENTROPY in needs or TOKEN_KL in needs:
            s_prob = s_all.exp()  # one full-vocabulary exp shared by the entropy and the KL
            if STUDENT_ENTROPY in needs:
                out["student_entropy"] = -(s_prob * s_all).sum(-1)
            if TOKEN_KL in needs:
                out["token_kl"] = (s_prob * (s_all - t_all)).sum(-1)
        return out

    def summarize(self, commits):
        return {"tokens": sum(c["tokens"] for c in commits), "seconds": sum(c["seconds"] for c in commits)}
