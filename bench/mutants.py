"""Mutation check: would the suite notice if the code were wrong?

Each mutation is one line of the package changed the way a plausible bug would change it (a sign, a
bound, an off-by-one, a skipped call). The package is copied once to a scratch folder
(``<scratch>/gndpo``, the tracked files of this checkout as they are on disk); each mutation changes its
one line there, the tests named for it run from that copy with ``PYTHONPATH=<scratch>``, so the test
process and every process it starts (the CLI, vLLM's engine, DeepSpeed's ranks) import the mutant, not
this checkout, and the line is put back. A mutation is *killed* when at least one of its tests fails,
*survives* when all pass, and is *timed out* when they hang. Before the mutants, the same tests run
once on the unchanged copy (the baseline): a test that fails there proves nothing about a mutant, so
the check stops.

Not in the suite (it runs the tests it names once per mutation: about 25 minutes on 2 CPU cores for
the 26, 10 of them the baselines of the two runs that made the table)::

    .venv/bin/python bench/mutants.py              # every mutation, then results/mutants.{json,md}
    .venv/bin/python bench/mutants.py --only gndpo-mean,advantage-sign   # rerun these, merged into the results
    .venv/bin/python bench/mutants.py --list       # the mutations and whether each applies

A surviving mutation means no test checks what that line does: it gets a test, and the check is rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, save_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    """``before`` (found exactly once in ``path``, a file of the package) becomes ``after``; ``tests``
    (pytest node ids or files) should fail."""

    name: str
    what: str
    path: str
    before: str
    after: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation(
        "advantage-sign", "the clamped score c = lpT - lpS (every policy-gradient method's advantage) negated",
        "pipeline/methods/distill.py",
        "np.clip(teacher_logprobs.astype(np.float64) - student_logprobs.astype(np.float64), -clamp, clamp)",
        "np.clip(student_logprobs.astype(np.float64) - teacher_logprobs.astype(np.float64), -clamp, clamp)",
        ("tests/test_learning.py", "tests/test_methods.py"),
    ),
    Mutation(
        "gndpo-clamp-bound", "the clamp's upper bound doubled (c up to +10)",
        "pipeline/methods/distill.py",
        "student_logprobs.astype(np.float64), -clamp, clamp)",
        "student_logprobs.astype(np.float64), -clamp, 2 * clamp)",
        ("tests/test_methods.py", "tests/test_method_family.py"),
    ),
    Mutation(
        "gndpo-mean", "GNDPO's global mean divided by N - 1 instead of N",
        "pipeline/methods/distill.py",
        "    mean = c_sum / n\n",
        "    mean = c_sum / (n - 1)\n",
        ("tests/test_methods.py", "tests/test_method_family.py"),
    ),
    Mutation(
        "gndpo-std", "GNDPO divides by the variance instead of the standard deviation",
        "pipeline/methods/distill.py",
        'return (c - stats["c_mean"]) / np.sqrt(stats["c_var"] + eps)',
        'return (c - stats["c_mean"]) / (stats["c_var"] + eps)',
        ("tests/test_methods.py", "tests/test_method_family.py"),
    ),
    Mutation(
        "gspo-clip-bounds", "the clipped ratio's lower and upper bounds swapped (clip_low and clip_high)",
        "pipeline/methods/losses.py",
        "torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)",
        "torch.clamp(ratio, 1.0 - clip_high, 1.0 + clip_low)",
        ("tests/test_methods.py", "tests/test_method_family.py", "tests/test_topk_forms.py"),
    ),
    Mutation(
        "topk-rest-term", "the top-k divergences lose their rest bucket (the mass outside the k ids)",
        "pipeline/methods/losses.py",
        "    return torch.cat([topk_logp, rest], dim=-1)\n",
        "    return topk_logp\n",
        ("tests/test_topk_forms.py", "tests/test_exact_tails.py", "tests/test_methods.py"),
    ),
    Mutation(
        "forward-kl-direction", "forward KL weighted by the student's probabilities instead of the teacher's",
        "pipeline/methods/losses.py",
        "terms = pt * (log_pt - log_ps)",
        "terms = ps * (log_pt - log_ps)",
        ("tests/test_learning.py", "tests/test_methods.py", "tests/test_topk_forms.py"),
    ),
    Mutation(
        "score-swaps-teacher-and-student", "score runs the student where the teacher goes and the teacher where the student goes",
        "stages/scoring/forward.py",
        "pair_token_stats(teacher, self.student, batch,",
        "pair_token_stats(self.student, teacher, batch,",
        ("tests/test_method_stages.py::test_bfloat16_score_storage", "tests/test_teachers.py"),
    ),
    Mutation(
        "response-slice-off-by-one", "each response token read from the hidden state at its own position, not the one before",
        "stages/models/logprobs.py",
        "return out.last_hidden_state[batch.rows, batch.cols]",
        "return out.last_hidden_state[batch.rows, batch.cols + 1]",
        ("tests/test_logprobs.py",),
    ),
    Mutation(
        "shared-prompt-positions", "the shared-prompt forward numbers response positions from one past the prompt's end",
        "stages/models/logprobs.py",
        "positions = prompt_lengths.unsqueeze(-1) + torch.arange(width, device=batch.ids.device)",
        "positions = prompt_lengths.unsqueeze(-1) + 1 + torch.arange(width, device=batch.ids.device)",
        ("tests/test_shared_prompts.py",),
    ),
    Mutation(
        "cross-tokenizer-span-sum", "a span's teacher value is its first teacher token's log-prob, not the span's sum",
        "stages/text/align.py",
        "teacher = sum(teacher_logprobs[i] for i in span.teacher)",
        "teacher = teacher_logprobs[span.teacher[0]]",
        ("tests/test_align.py", "tests/test_cross_tokenizer.py"),
    ),
    Mutation(
        "normalize-token-mask", "normalize's per-token view keeps tokens whose loss mask is 0",
        "stages/normalize.py",
        'else "unnest(r.loss_mask)")',
        'else "unnest(list_transform(r.loss_mask, lambda x: 1))")',
        ("tests/test_method_stages.py",),
    ),
    Mutation(
        "train-resume-skips-a-step", "a resumed train starts one step after the last checkpointed one",
        "stages/train.py",
        "for i in range(len(history), len(update.steps)):",
        "for i in range(len(history) + bool(history), len(update.steps)):",
        ("tests/test_resilience.py::test_crashed_train_resumes_without_repeating_steps",),
    ),
    Mutation(
        "kept-engine-no-reload", "the kept vLLM engine is not given the new policy's weights",
        "stages/models/live.py",
        'live.llm.collective_rpc("reload_policy", kwargs={"weights_path": policy} if weights is None else {"weights": weights})',
        "pass",
        ("tests/test_e2e.py::test_kept_engines_give_the_rows_and_weights_of_fresh_processes",),
    ),
    # The code added after the first table: teacher servers, hub ids, answers, the held-out measures, streamed
    # rounds, the exact quantile, automatic checkpointing, one training file.
    Mutation(
        "engine-rest-drops-last", "the vllm and server backends' rest mass computed from all but the last top-k entry",
        "stages/teachers/engine.py",
        'teacher_rest_logprob=rest_logprob_from_topk(answers[0]["topk_logprobs"]))',
        'teacher_rest_logprob=rest_logprob_from_topk(answers[0]["topk_logprobs"][:, :-1]))',
        ("tests/test_score_backend.py", "tests/test_teacher_servers.py::test_several_teachers_other_tokenizers_and_self_distillation_through_servers"),
    ),
    Mutation(
        "server-request-temperature", "server requests no longer force temperature 1 (the server's default applies)",
        "stages/models/teacher_server.py",
        '"temperature": 1.0, "top_p": 1.0, "top_k": -1',
        '"top_p": 1.0, "top_k": -1',
        ("tests/test_server_outage.py",),
    ),
    Mutation(
        "server-no-cooldown", "a failed server stays in the pool (no cooldown before its next request)",
        "stages/models/teacher_server.py",
        "server.down_until = now + cooldown",
        "server.down_until = now",
        ("tests/test_server_outage.py",),
    ),
    Mutation(
        "checkpointing-threshold", "train.gradient_checkpointing auto turns on above 85% of the GPU instead of 70%",
        "stages/models/gpu_memory.py",
        "train_peak(cfg, Shape.of(student), gpu, checkpointing=False, ranks=ranks).bytes > WARN * gpu",
        "train_peak(cfg, Shape.of(student), gpu, checkpointing=False, ranks=ranks).bytes > 0.85 * gpu",
        ("tests/test_gpu_memory.py",),
    ),
    Mutation(
        "zero2-gradients-whole", "the memory estimate keeps every rank's gradients whole under ZeRO-2 (split only under ZeRO-3)",
        "stages/models/gpu_memory.py",
        "gradients = GRAD_BYTES / (ranks if train_cfg.zero_stage >= 2 else 1)",
        "gradients = GRAD_BYTES / (ranks if train_cfg.zero_stage >= 3 else 1)",
        ("tests/test_gpu_memory.py::test_zero_stages_split_their_shares_over_the_ranks",),
    ),
    Mutation(
        "auto-takes-a-slower-order", "run.overlap auto takes an overlapped order where the round model predicts it slower, not faster",
        "apps/round_model.py",
        "if times[order] < times[best] * (1 - MARGIN):",
        "if times[order] > times[best] * (1 - MARGIN):",
        ("tests/test_round_model.py::test_auto_never_picks_an_order_predicted_slower_than_sequential",),
    ),
    Mutation(
        "overlap-on-shared-devices-gains", "the round model lets stages that share devices run side by side at no cost to each other",
        "apps/round_model.py",
        "    shared = 0.0 if machine.split else actor",
        "    shared = 0.0",
        ("tests/test_round_model.py::test_two_cores_gain_only_what_does_not_scale",),
    ),
    Mutation(
        "fused-softmax-term-dropped", "the fused output layer's logit gradient keeps the sparse part and drops the softmax term",
        "stages/models/fused_output.py",
        "grad = numerator.mul_(-c / total).scatter_add_(-1, ids, grad_g)",
        "grad = numerator.mul_(0.0).scatter_add_(-1, ids, grad_g)",
        ("tests/test_fused_output.py::test_the_closed_form_is_autograd_through_log_softmax",),
    ),
    Mutation(
        "fused-split-response-first-pass-reused", "a response longer than a chunk takes its gradient from the first chunk's logits for every chunk",
        "stages/models/fused_output.py",
        "            local = slice(sl.start - start, sl.stop - start)",
        "            local = slice(0, sl.stop - sl.start)",
        ("tests/test_fused_output.py::test_the_closed_form_is_autograd_through_log_softmax",),
    ),
    Mutation(
        "final-round-writes-state", "the run's last round writes its optimizer state though train.final_state is off",
        "stages/train.py",
        "due = (self.round + 1) % train_cfg.state_every == 0 and (train_cfg.final_state or not self.context.final)",
        "due = (self.round + 1) % train_cfg.state_every == 0",
        ("tests/test_state_every.py::test_a_one_round_job_writes_no_state_and_extending_it_replays_exactly",),
    ),
    Mutation(
        "hub-resume-by-revision", "a run's later processes load a hub model's revision (which may have moved) instead of its recorded commit",
        "storage/hub.py",
        'revision=record["commit"], local_files_only=True',
        'revision=record["revision"], local_files_only=True',
        ("tests/test_hub_models.py",),
    ),
    Mutation(
        "answers-for-teacher-context", "a teacher context that shows {answer} is not counted as needing answers",
        "pipeline/methods/__init__.py",
        'if "answer" in cfg.teacher_context.columns():',
        'if "answers" in cfg.teacher_context.columns():',
        ("tests/test_prompts_without_answers.py::test_what_needs_answers",),
    ),
    Mutation(
        "heldout-greedy-sampled-swapped", "the label-free held-out measure reads the greedy responses as the sampled ones and back",
        "stages/score.py",
        "greedy, drawn = sampled & (sample == 0), sampled & (sample == 1)",
        "greedy, drawn = sampled & (sample == 1), sampled & (sample == 0)",
        ("tests/test_prompts_without_answers.py::test_two_rounds_of_gndpo_on_prompts_only",),
    ),
    Mutation(
        "streamed-step-order", "a streamed step's rows come back in shard order, not the step's shuffled order",
        "stages/training/batch.py",
        "join(*split_rows(table.sort_by(POSITION)))",
        "join(*split_rows(table))",
        ("tests/test_streamed_rounds.py",),
    ),
    Mutation(
        "quantile-interpolation", "the exact quantile interpolates from the upper order statistic instead of the lower",
        "pipeline/methods/base.py",
        '{"d": rank - below,',
        '{"d": 1 - (rank - below),',
        ("tests/test_quantiles.py",),
    ),
    Mutation(
        "served-teacher-record-ignored", "worker starts compare the servers with the pool's first server, not the teacher recorded at init",
        "stages/teachers/served.py",
        "gap = probe_gap(scores, reference)",
        "gap = probe_gap(scores, answers)",
        ("tests/test_teacher_servers.py::test_a_server_redeployed_with_other_weights_is_refused_at_the_next_worker_start",),
    ),
    Mutation(
        "outage-deadline-doubled", "a pool-wide outage fails at twice score.server_outage_s",
        "stages/models/teacher_server.py",
        "        if left <= 0:",
        "        if left <= -self.settings.outage_s:",
        ("tests/test_server_outage.py",),
    ),
    Mutation(
        "heldout-split-cap", "one prompt more than data.heldout_max is held out of data.train",
        "pipeline/run/prompts.py",
        "ranked[: data.heldout_max]",
        "ranked[: data.heldout_max + 1]",
        ("tests/test_one_train_file.py",),
    ),
    Mutation(
        "stale-behaviour-is-current", "with run.max_staleness, score's student column (the behaviour log-probs train's ratio divides by) "
        "from the round's newest policy instead of the one that sampled",
        "stages/score.py",
        "policy = self.run.policy_path(self.run.sampling_version(self.round))",
        "policy = self.run.policy_path(self.round)",
        ("tests/test_overlap.py",),
    ),
    Mutation(
        "train-ratio-against-itself", "train's importance ratio taken against the current policy's own log-probs (always 1)",
        "stages/training/objective.py",
        '        old = padded(micro, "old_logp", width, device)\n',
        "        old = logp.detach()\n",
        ("tests/test_overlap.py", "tests/test_methods.py"),
    ),
    # Issue 71, points 1-3 and 9: the teacher servers' outage clock and retries, URL checks, strict config types.
    Mutation(
        "outage-from-last-answer", "a pool-wide outage counted from the last answer alone, not from when the last server began failing "
        "(an outage after a long request fails at once)",
        "stages/models/teacher_server.py",
        "start = max(self.last_answer, self.failing_since)",
        "start = self.last_answer",
        ("tests/test_server_outage.py::test_an_outage_after_a_long_request_waits_the_deadline_from_its_failure",
         "tests/test_server_outage.py::test_the_outage_clock_starts_when_the_last_server_fails_and_not_again_at_each_failure"),
    ),
    Mutation(
        "outage-clock-restarts-at-each-failure", "the outage clock restarted at every failure while every server fails (a probation "
        "failure every cooldown: with the defaults the outage never ends)",
        "stages/models/teacher_server.py",
        "if self.failing_since is None and all(s.failures for s in self.servers):",
        "if all(s.failures for s in self.servers):",
        ("tests/test_server_outage.py::test_the_outage_clock_starts_when_the_last_server_fails_and_not_again_at_each_failure",),
    ),
    Mutation(
        "server-retries-one-fewer", "a request that fails while other servers answer is sent score.server_retries times, one retry fewer",
        "stages/models/teacher_server.py",
        "if failures > self.settings.retries:",
        "if failures >= self.settings.retries:",
        ("tests/test_server_outage.py::test_a_request_failing_while_others_answer_is_sent_once_plus_its_retries",),
    ),
    Mutation(
        "server-port-65536-accepted", "a teacher server's URL with port 65536 accepted at init (httpx parses it)",
        "pipeline/config/checks.py",
        "not 0 < parsed.port < 65536",
        "not 0 < parsed.port <= 65536",
        ("tests/test_server_outage.py::test_a_server_port_is_1_to_65535",),
    ),
    Mutation(
        "config-lax-bools", "bool settings validated laxly: 1, 0, \"yes\", \"no\", \"true\" become True or False",
        "pipeline/config/validate.py",
        "strict = {int: StrictInt, bool: StrictBool,",
        "strict = {int: StrictInt, bool: bool,",
        ("tests/test_config.py::test_every_bool_int_float_and_str_setting_refuses_a_value_of_another_type",),
    ),
    Mutation(
        "config-lax-ints", "int settings validated laxly: \"3\", 2.0 and True become 3, 2 and 1",
        "pipeline/config/validate.py",
        "strict = {int: StrictInt,",
        "strict = {int: int,",
        ("tests/test_config.py::test_every_bool_int_float_and_str_setting_refuses_a_value_of_another_type",),
    ),
    # Issue 71, points 4, 5, 10 and 11: resume across world sizes, the self-teacher and the rows at staleness 1.
    Mutation(
        "resume-ignores-world-size", "train continues after an in-round checkpoint written by another number of ranks (whose "
        "ZeRO partitions it cannot load: the update goes on from the round's initial weights, the steps taken skipped)",
        "stages/training/checkpoint.py",
        '                    if found.world != dist.world:\n                        continue\n',
        "",
        ("tests/test_resume_world_size.py",),
    ),
    Mutation(
        "self-teacher-newest-policy", "with run.max_staleness, a live or EMA self-teacher is the round's newest policy, not the one that sampled it",
        "pipeline/run/run.py",
        "        version = self.sampling_version(round_idx)\n",
        "        version = round_idx\n",
        ("tests/test_self_distill.py::test_a_self_teacher_that_follows_the_student_is_the_policy_that_sampled_the_round",),
    ),
    Mutation(
        "policy-version-metric-wrong", "rollout's policy_version figure (manifest, metrics.jsonl) names the round, not the policy that sampled it",
        "stages/rollout.py",
        '            "policy_version": self.version,\n            "staleness"',
        '            "policy_version": self.round,\n            "staleness"',
        ("tests/test_overlap.py::test_round_1_samples_with_policy_0_and_says_so",),
    ),
    # Issue 71, points 6-8: stage CPUs, the held-out split's boundary, the kept server pool's re-check.
    Mutation(
        "stage-cpus-not-applied", "GNDPO_STAGE_CPUS parsed and planned, but a stage process never pinned to its cores",
        "apps/rounds.py",
        "        os.sched_setaffinity(0, cpus)\n",
        "        pass\n",
        ("tests/test_stage_cpus.py",),
    ),
    Mutation(
        "stage-cpus-not-passed", "the scheduler starts every stage unpinned instead of on the cores GNDPO_STAGE_CPUS names for it",
        "apps/schedule.py",
        "order, cpus.get(stage, ()), log, final=",
        "order, (), log, final=",
        ("tests/test_stage_cpus.py",),
    ),
    Mutation(
        "heldout-boundary", "a prompt ranked exactly at data.heldout_share held out (<= for the documented <)",
        "pipeline/run/prompts.py",
        "if rank < data.heldout_share}",
        "if rank <= data.heldout_share}",
        ("tests/test_one_train_file.py::test_a_prompt_ranked_exactly_at_the_share_is_trained_on",),
    ),
    Mutation(
        "kept-pool-not-rechecked", "a kept teacher server pool handed to the next round's worker without checking it again",
        "stages/models/live.py",
        "        if pool is not None:\n            check(pool)\n            return pool\n",
        "        if pool is not None:\n            return pool\n",
        ("tests/test_kept_pool.py",),
    ),
    Mutation(
        "served-check-without-record", "a score worker holds the teacher's servers to each other only, not to the probe init recorded",
        "stages/teachers/served.py",
        "recorded = (setup.run.served_probes or {}).get(name)",
        "recorded = None",
        ("tests/test_kept_pool.py",),
    ),
    # Issue 71: more of the code added since f025f0f (scheduler, per-unit reads, staleness, validator).
    Mutation(
        "sampling-version-staleness-capped", "run.max_staleness above 1 samples as if it were 1 (round k with policy k-1, not k-s)",
        "pipeline/run/run.py",
        "return max(round_idx - self.cfg.run.max_staleness, 0)",
        "return max(round_idx - min(self.cfg.run.max_staleness, 1), 0)",
        ("tests/test_staleness_rules.py::test_each_round_samples_with_the_policy_exactly_its_staleness_behind",),
    ),
    Mutation(
        "fingerprint-staleness-as-flag", "the run's identity hashes whether run.max_staleness is set, not its value (a rerun at 2 mixes into a run at 1)",
        "pipeline/settings/schema.py",
        'settings["run"] = {"max_staleness": self.run.max_staleness}',
        'settings["run"] = {"max_staleness": bool(self.run.max_staleness)}',
        ("tests/test_staleness_rules.py::test_every_staleness_is_a_run_identity_of_its_own",),
    ),
    Mutation(
        "rollout-samples-with-newest-policy", "with run.max_staleness, rollout's engine gets the newest policy while its rows record the sampling version",
        "stages/rollout.py",
        "        policy = self.run.policy_path(self.version)\n",
        "        policy = self.run.policy_path(self.round)\n",
        ("tests/test_staleness_rules.py::test_a_stale_round_rolls_out_on_its_sampling_policy",),
    ),
    Mutation(
        "fork-changes-sampling-policy", "a fork may change run.max_staleness at round K>0: K's inherited rows are scored as sampled by another policy",
        "apps/fork.py",
        "    if version != sampled:\n",
        "    if False:  # no check (before issue 71)\n",
        ("tests/test_staleness_rules.py::test_a_fork_keeps_the_policy_its_rollouts_were_sampled_with",),
    ),
    Mutation(
        "fork-skips-staleness-check", "gndpo fork accepts a loss without an importance ratio at run.max_staleness 1 (init refuses it)",
        "apps/fork.py",
        "    check_staleness(local)\n",
        "",
        ("tests/test_staleness_rules.py::test_a_fork_at_staleness_1_refuses_a_loss_without_a_ratio",),
    ),
    Mutation(
        "committed-stages-remembers-asking", "the scheduler's record of committed stages counts a stage committed once asked about, manifest or not",
        "apps/schedule.py",
        "        if self.run.records(round_idx, stage).manifest() is None:\n            return False\n        self.known.add((round_idx, stage))\n",
        "        self.known.add((round_idx, stage))\n        if self.run.records(round_idx, stage).manifest() is None:\n            return False\n",
        ("tests/test_schedule.py::test_a_stage_counts_as_committed_only_once_its_manifest_is_written",),
    ),
    Mutation(
        "unit-ready-any-commit", "a following score unit is claimed once any rollout unit has committed, not its own",
        "pipeline/exec/inputs.py",
        "        return unit in seen\n",
        "        return bool(seen)\n",
        ("tests/test_schedule.py::test_a_following_score_unit_waits_for_its_own_rollout_unit",),
    ),
    Mutation(
        "exclusive-bound-inclusive", "the validator reads an exclusive upper bound as inclusive (self_teacher.ema_decay 1, an average that never moves)",
        "pipeline/config/validate.py",
        "annotated_types.Interval(gt=c.gt, ge=c.ge, lt=c.lt, le=c.le)",
        "annotated_types.Interval(gt=c.gt, ge=c.ge, le=c.le if c.lt is None else c.lt)",
        ("tests/test_cli.py::test_init_refuses_bad_values_before_writing[method.jsd_beta=1]",),
    ),
    Mutation(
        "served-probe-nan-accepted", "a teacher server whose probe log-probs are NaN passes the check against the record (gap > tol is False for NaN)",
        "stages/teachers/served.py",
        "        gap = probe_gap(scores, reference)\n        if not gap <= tolerance:\n",
        "        gap = probe_gap(scores, reference)\n        if gap > tolerance:\n",
        ("tests/test_served_record.py::test_each_server_is_held_to_the_record_and_an_unmeasurable_answer_is_refused",),
    ),
    Mutation(
        "fork-records-todays-probe", "a run made from a recorded served teacher (a fork) records the servers' answers of today instead of the record",
        "stages/teachers/served.py",
        "record[name] = kept or pool.probe",
        "record[name] = pool.probe",
        ("tests/test_served_record.py::test_a_run_made_from_a_record_keeps_the_record",),
    ),
    Mutation(
        "score-sums-float32", "score shards store the per-response sum of c^2 in float32 (normalize's variance cancels to noise)",
        "storage/rows.py",
        "c_sq_sum: Annotated[float, pa.float64()]",
        "c_sq_sum: Annotated[float, pa.float32()]",
        ("tests/test_stored_sums.py",),
    ),
    Mutation(
        "resume-drops-checkpoint-ema", "a train resumed from an in-round checkpoint restarts the EMA average from the round's start",
        "stages/training/checkpoint.py",
        '            ema.load_bytes(verified_bytes(run.fs, FileRecord.of(point.state.ema)))\n',
        "            pass\n",
        ("tests/test_checkpoint_start.py",),
    ),
    Mutation(
        "resume-forgets-checkpoint-history", "a train resumed from an in-round checkpoint keeps its weights but forgets its steps (takes them all again)",
        "stages/training/checkpoint.py",
        'return Start(list(point.state.history), point.state.step, True)',
        'return Start([], point.state.step, True)',
        ("tests/test_checkpoint_start.py",),
    ),
    Mutation(
        "rollout-reads-include-heldout", "a rollout manifest's row files include the evaluation unit's files (held-out responses read as training rows)",
        "storage/products.py",
        "        return [f for unit in self.work() for f in unit.files]\n",
        "        return [f for unit in self.units for f in unit.files]\n",
        ("tests/test_schedule.py::test_the_rollouts_a_stage_reads_are_the_response_shards_not_the_evaluation_units_files",),
    ),
    # Issue 71, what to build 4: what an in-process command releases when it returns.
    Mutation(
        "vllm-import-traceback-kept", "make_llm leaves vLLM's stored import error (torchcodec's) its traceback: the frames of the process's "
        "first `import vllm`, with the first engine among their locals, stay for the life of the process",
        "stages/models/vllm_engine.py",
        "    _drop_import_tracebacks()\n    in_process = runs_in_process(kwargs)\n",
        "    in_process = runs_in_process(kwargs)\n",
        ("tests/test_releases.py::test_no_import_error_vllm_keeps_holds_the_frames_of_its_importers",),
    ),
    Mutation(
        "reload-records-kept", "an in-process engine shut down without forgetting vLLM's reload records: a reloaded model stays alive",
        "stages/models/vllm_engine.py",
        '        core.collective_rpc("forget_reload_records")\n',
        "        pass\n",
        ("tests/test_releases.py::test_stage_commands_and_a_closed_kept_set_leave_no_engine_or_model_alive",),
    ),
    Mutation(
        "trainer-not-destroyed", "a DeepSpeed engine whose life ends is dropped without DeepSpeedEngine.destroy (its ZeRO gradient hooks keep it)",
        "stages/models/live.py",
        "            if destroy is not None:\n                destroy()\n",
        "",
        ("tests/test_releases.py::test_stage_commands_and_a_closed_kept_set_leave_no_engine_or_model_alive",),
    ),
    Mutation(
        "zero3-module-left-on-stack", "a released ZeRO-3 engine's model left on DeepSpeed's FWD_MODULE_STACK (it keeps the engine)",
        "stages/models/live.py",
        "            _forget_zero3_module(engine)\n",
        "",
        ("tests/test_releases.py::test_stage_commands_and_a_closed_kept_set_leave_no_engine_or_model_alive",),
    ),
    Mutation(
        "stage-set-not-closed", "run_stage called without engines leaves the set it built open: the stage's engines are never released",
        "apps/rounds.py",
        "        finally:\n            own.close()\n",
        "        finally:\n            pass\n",
        ("tests/test_releases.py::test_stage_commands_and_a_closed_kept_set_leave_no_engine_or_model_alive",),
    ),
    # Issue 71, what to build 1: what the fast tier and the servers showed under other kernel paths.
    Mutation(
        "server-topk-by-reported-rank", "a served or engine teacher's top-k taken by the rank vLLM reports (a miscounted one lets the sampled token in)",
        "stages/models/prompt_logprobs.py",
        "ranked = sorted((-lp, tid) for tid, (rank, lp) in entry.items() if rank is not None)[:topk]",
        "ranked = [(-lp, tid) for _, tid, lp in sorted((rank, tid, lp) for tid, (rank, lp) in entry.items() if rank is not None and rank <= topk)][:topk]",
        ("tests/test_exact_tails.py::test_a_servers_top_k_is_its_largest_log_probs_whatever_rank_it_reports",),
    ),
    # Issue 76: the tied output layer's gradient, and the retries of a scoring request.
    Mutation(
        "tied-fused-grad-replaces-lookup", "a tied output layer's fused weight gradient overwrites an earlier micro-batch's in .grad instead of adding to it",
        "stages/models/fused_output.py",
        "                weight.grad.add_(grad_weight)",
        "                weight.grad.copy_(grad_weight)",
        ("tests/test_fused_output.py::test_a_tied_output_layer_takes_its_lookup_rows_in_place_and_matches_the_checkpointed_path",),
    ),
    Mutation(
        "tied-lookup-dense", "a tied embedding's lookup keeps its dense gradient, a second [V, H] in the backward",
        "stages/models/fused_output.py",
        "        embedding.sparse = True",
        "        embedding.sparse = False",
        ("tests/test_fused_output.py::test_a_tied_output_layer_takes_its_lookup_rows_in_place_and_matches_the_checkpointed_path",),
    ),
    Mutation(
        "retry-returns-to-failed-server", "a retried scoring request may go back to the server it failed on while another is in the pool",
        "stages/models/teacher_server.py",
        "untried = [s for s in self.servers if s.url not in avoid and now >= s.down_until]",
        "untried = [s for s in self.servers if now >= s.down_until]",
        ("tests/test_server_outage.py::test_a_retry_goes_to_a_server_the_request_has_not_failed_on",),
    ),
]


def copy_package(scratch: Path) -> Path:
    """The tracked files of this checkout, as they are on disk, under ``scratch/gndpo``."""
    package = scratch / "gndpo"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        source = ROOT / name
        if source.is_file():
            (package / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, package / name)
    return package


def applied(text: str, mutation: Mutation) -> str:
    """``text`` with the mutation's line changed; raises unless ``before`` occurs exactly once."""
    count = text.count(mutation.before)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name}: {mutation.path} holds its line {count} times, not once")
    return text.replace(mutation.before, mutation.after)


def importing(package: Path) -> dict:
    """The environment of a process that imports the copy at ``package`` before this checkout."""
    env = {**os.environ, "PYTHONPATH": str(package.parent)}
    env.pop("CI", None)  # a missing component skips here, as it would in a local run
    return env


def run_tests(package: Path, tests: tuple[str, ...], timeout_s: int) -> dict:
    """Run ``tests`` with the copy at ``package`` first on the import path: its outcome, pytest's
    summary line and the names of the tests that failed."""
    files = {t.split("::")[0] for t in tests}
    workers = ["-n", "2", "--dist", "loadfile"] if len(files) > 1 else []  # a test file per worker, as `make test`
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *workers, *tests]
    t0 = time.time()
    try:
        proc = subprocess.run(argv, cwd=package, env=importing(package), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"outcome": "timed out", "summary": f"over {timeout_s} s", "failed": [], "seconds": round(time.time() - t0)}
    lines = proc.stdout.strip().splitlines()
    summary = re.sub(r", \d+ warnings?", "", lines[-1].strip("= ")) if lines else proc.stderr.strip()[-300:]
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)))
    outcome = "passed" if proc.returncode == 0 else "failed" if proc.returncode == 1 else f"pytest exit {proc.returncode}"
    return {"outcome": outcome, "summary": summary, "failed": failed, "seconds": round(time.time() - t0)}


def imports_the_copy(package: Path) -> None:
    """Check that a process started like the tests imports the scratch copy, not this checkout."""
    where = subprocess.run([sys.executable, "-c", "import gndpo; print(gndpo.__file__)"], cwd=package, env=importing(package),
                           capture_output=True, text=True, check=True).stdout.strip()
    if Path(where).resolve() != (package / "__init__.py").resolve():
        raise SystemExit(f"the scratch copy is not what imports: gndpo came from {where}")


def check(mutations: list[Mutation], timeout_s: int) -> dict:
    """The baseline on the unchanged copy, then each mutation in turn: applied to the copy, its tests
    run, the line put back."""
    with tempfile.TemporaryDirectory(prefix="gndpo-mutants-") as scratch:
        package = copy_package(Path(scratch))
        imports_the_copy(package)
        tests = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
        print(f"baseline: {len(tests)} test selections on the unchanged copy", flush=True)
        baseline = run_tests(package, tests, timeout_s * 2)
        print(f"  {baseline['outcome']}: {baseline['summary']} ({baseline['seconds']} s)", flush=True)
        if baseline["outcome"] != "passed":
            raise SystemExit(f"the baseline does not pass ({baseline['failed']}): fix the suite first")
        results = []
        for mutation in mutations:
            target = package / mutation.path
            original = target.read_text()
            target.write_text(applied(original, mutation))
            try:
                result = run_tests(package, mutation.tests, timeout_s)
            finally:
                target.write_text(original)
            # A hang is not a kill: it would stop a suite, not fail one test for what the line does.
            verdict = {"passed": "survived", "timed out": "timed out"}.get(result["outcome"], "killed")
            print(f"{mutation.name}: {verdict} ({result['summary']}, {result['seconds']} s)", flush=True)
            results.append({**asdict(mutation), **result, "verdict": verdict})
    baseline["tests"] = list(tests)
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "baselines": [baseline], "mutations": results}


def merged(old: dict | None, new: dict) -> dict:
    """``new``'s mutations in place of ``old``'s of the same name (a rerun of some with ``--only``), in
    the order of MUTATIONS; the baselines of both runs. Each mutation keeps the machine and date it ran
    on, so a rerun of some on another CPU type keeps the others' results, labelled with theirs."""
    if old is None:
        return new
    for data in (old, new):
        for m in data["mutations"]:
            m.setdefault("machine", data["machine"])
            m.setdefault("date", data["date"])
        for b in data["baselines"]:
            b.setdefault("machine", data["machine"])
            b.setdefault("date", data["date"])
    by_name = {m["name"]: m for m in old["mutations"]} | {m["name"]: m for m in new["mutations"]}
    order = [m.name for m in MUTATIONS if m.name in by_name]
    return {**new, "baselines": [*old["baselines"], *new["baselines"]], "mutations": [by_name[n] for n in order]}


def markdown(data: dict) -> str:
    rows = [
        "| mutation | what changes | file | tests run | result | failing tests | run on |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in data["mutations"]:
        tests = "<br>".join(f"`{t.removeprefix('tests/')}`" for t in m["tests"])
        failing = "<br>".join(f"`{t.removeprefix('tests/')}`" for t in m["failed"][:3]) or "none"
        where = f"{m.get('date', data['date'])}, {m.get('machine', data['machine'])}"
        rows.append(f"| `{m['name']}` | {m['what']} | `{m['path']}` | {tests} | **{m['verdict']}** ({m['summary']}, {m['seconds']} s) | {failing} | {where} |")
    killed = sum(m["verdict"] == "killed" for m in data["mutations"])
    baselines = "; ".join(f"{b['summary']} in {b['seconds']} s ({b.get('date', data['date'])}, {b.get('machine', data['machine'])})"
                          for b in data["baselines"])
    return "\n".join([
        f"{killed} of {len(data['mutations'])} mutations killed. Each row names the day and machine its tests ran on. The tests "
        f"run first on the unchanged copy: {baselines}. Each mutant's run stops at its first failure (`-x`).",
        "",
        *rows,
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutation names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and check each applies")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per mutation's tests")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only.split(",")]
    for m in chosen:
        applied((ROOT / m.path).read_text(), m)
    if args.list:
        for m in chosen:
            print(f"{m.name:34} {m.path:30} {' '.join(m.tests)}")
        return
    data = check(chosen, args.timeout)
    saved = RESULTS / "mutants.json"
    data = merged(json.loads(saved.read_text()) if saved.exists() and args.only else None, data)
    save_json(saved, data)
    (RESULTS / "mutants.md").write_text(markdown(data))
    print(markdown(data))
    if any(m["verdict"] != "killed" for m in data["mutations"]):  # survived or timed out
        sys.exit(1)


if __name__ == "__main__":
    main()
