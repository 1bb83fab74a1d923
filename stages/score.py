"""Score: the teacher's and the (recomputed) student's log-prob of every sampled token.

One score unit per rollout unit. Both models run the same forward as train (``response_logprobs``) in
chunks of ``score.rows_per_chunk`` responses, so only one chunk's logits exist at a time. The student's
log-probs use the sampling temperature, the teacher's temperature 1 (shared/ALGORITHMS.md, notation).
Each row also carries the partial sums of the clamped score c_t that normalize aggregates. Non-finite
log-probs are refused: a NaN here would silently poison the round's global statistics.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.methods import clamped_score, score_partial_sums
from gndpo.pipeline.runs import Run
from gndpo.stages.modeling import check_same_tokenizer, load_causal_lm, load_tokenizer, response_logprobs, set_cpu_threads
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
        return units, {"rollout_manifest_finished_at": rollouts["finished_at"], "teacher": self.cfg.teacher}

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
        rows = []
        for start in range(0, len(responses), chunk):
            sl = slice(start, start + chunk)
            t_lp, _, _ = response_logprobs(self.teacher, prompts[sl], responses[sl], self.pad_id, 1.0)
            s_lp, _, _ = response_logprobs(self.student, prompts[sl], responses[sl], self.pad_id, temperature)
            for i, (resp, mask) in enumerate(zip(responses[sl], masks[sl])):
                n = len(resp)
                t, s = t_lp[i, :n].numpy(), s_lp[i, :n].numpy()
                if not (np.isfinite(t).all() and np.isfinite(s).all()):
                    rid = table.column("rollout_id")[start + i].as_py()
                    raise GndpoError(f"non-finite log-probs for rollout {rid} in round {self.round}; refusing to score")
                c = clamped_score(t, s, self.cfg.method.clamp)
                rows.append(
                    {
                        "teacher_logprobs": t.astype(np.float32),
                        "student_logprobs": s.astype(np.float32),
                        **score_partial_sums(c, np.asarray(mask, dtype=np.float64)),
                    }
                )
        out = pa.table(
            {
                "rollout_id": table.column("rollout_id"),
                "prompt_id": table.column("prompt_id"),
                "teacher_logprobs": pa.array([r["teacher_logprobs"] for r in rows], pa.list_(pa.float32())),
                "student_logprobs": pa.array([r["student_logprobs"] for r in rows], pa.list_(pa.float32())),
                **{k: pa.array([r[k] for r in rows], SCORES.field(k).type) for k in ("n_valid", "c_sum", "c_sq_sum", "c_min", "c_max")},
                "teacher": pa.array([self.cfg.teacher] * len(rows), pa.string()),
            },
            schema=SCORES,
        )
        record = write_shard(self.run.fs, f"{out_dir}/part-00000.parquet", out)
        return [record], {"tokens": int(sum(r["n_valid"] for r in rows))}

    def summarize(self, commits):
        return {"tokens": sum(c["tokens"] for c in commits), "seconds": sum(c["seconds"] for c in commits)}
