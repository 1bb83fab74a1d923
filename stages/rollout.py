"""Rollout: the round's student samples n responses per prompt, on the sampler ``rollout.backend`` opens
(vLLM by default, or the student's own module: :mod:`gndpo.stages.samplers`).

Units are fixed slices of the round's prompt list. Every request carries its own seed derived from
(run seed, round, prompt_id, sample index), never from a worker, so a retried unit reproduces its rows.
Rows store token ids, the sampler's log-probs, the loss mask, every registered verifiable reward
(GNDPO only logs them) and the sampling settings. With ``rollout.guided_fraction`` > 0 (TrOPD's
off-policy guidance) the teacher writes the first ``guide_prefix_tokens`` tokens of a seeded subset
of prompts and the student continues; those tokens get loss_mask 0 and ``teacher_prefix_len`` says
how many there are. With ``rollout.tools`` a response is a conversation with tool turns
(:mod:`gndpo.stages.text.agent`), with its turns and calls in the row. With ``rollout.eval_heldout`` an extra unit measures the same policy's
greedy held-out accuracy on the same engine, which is what the demo's per-round table reports.
"""

from __future__ import annotations

import dataclasses
import random
from functools import partial

from gndpo.faults import crash_point
from gndpo.pipeline.exec.inputs import Read
from gndpo.pipeline.exec.stage import Launch, StageContext, StageJob
from gndpo.pipeline.observe import progress
from gndpo.pipeline.run.images import RunImages
from gndpo.pipeline.run.products import POLICY, ROLLOUTS, HeldoutFigures, RolloutNumbers
from gndpo.pipeline.run.run import Run
from gndpo.pipeline.run.seeds import derived_seed
from gndpo.pipeline.tasks.rewards import get_reward, run_rewards, score_response
from gndpo.stages.models.device import local_device
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.loading import check_same_tokenizer, load_tokenizer, unsampleable
from gndpo.stages.models.sampling import SamplingRequest
from gndpo.stages.samplers.registry import rollout_backend
from gndpo.stages.text.agent import Conversation, ToolUse, conversation_counts, conversation_metrics, run_conversations
from gndpo.stages.text.chat import render_prompt, stop_token_ids
from gndpo.stages.text.guide import TeacherGuide
from gndpo.stages.text.heldout_eval import HeldoutTask, greedy_eval
from gndpo.storage.products import Commit, FileKind, Unit, UnitKind
from gndpo.storage.rows import RolloutRow, rows_table
from gndpo.storage.shards import ROLLOUTS as ROLLOUT_SCHEMA
from gndpo.storage.shards import write_shard

# The held-out evaluation's unit: the same policy's greedy held-out responses, on the same sampler.
HELDOUT_UNIT = Unit("eval-heldout", UnitKind.HELDOUT_EVAL)


def sample_seed(base: int, round_idx: int, prompt_id: str, sample_idx: int) -> int:
    return derived_seed(base, round_idx, prompt_id, sample_idx)


def round_prompt_ids(prompt_ids: list[str], round_idx: int, count: int, seed: int) -> list[str]:
    """The round's prompts: positions [round*count, (round+1)*count) of an endless sequence of seeded
    permutations of the prompt set, so rounds see new prompts until the set is used up. A prompt appears
    at most once per round (rollout ids are unique per round, prompt and sample)."""
    base = sorted(prompt_ids)
    count = min(count, len(base))
    perms: dict[int, list[str]] = {}
    out: list[str] = []
    chosen: set[str] = set()
    pos = round_idx * count
    while len(out) < count:
        epoch, i = divmod(pos, len(base))
        if epoch not in perms:
            perms[epoch] = random.Random(f"{seed}:{epoch}").sample(base, len(base))
        pid = perms[epoch][i]
        if pid not in chosen:
            chosen.add(pid)
            out.append(pid)
        pos += 1
    return out


class RolloutJob(StageJob):
    """The rollout stage: each unit samples ``rollout.n`` responses for its prompts with the round's
    policy on its sampler (tool turns included), rewards them, and writes one rollout shard."""

    makes = ROLLOUTS
    # The policy that samples: exported by round k-1's train, or k-1-s's with run.max_staleness s
    # (version 0, the config's student, has none).
    reads = (Read(POLICY, sampling_policy=True),)
    # A worker per engine (engine.tensor_parallel_size GPUs each); the actor's GPUs with --learner-gpus.
    launch = Launch(per_gpu=True, tensor_parallel=True, actor=True)

    def __init__(self, run: Run, round_idx: int, context: StageContext | None = None):
        super().__init__(run, round_idx, context)
        self.live = self.context.live or LiveModels()
        self.sampler = self.tok = None
        self.version = run.sampling_version(round_idx)  # the policy that samples: stored in every row

    def plan(self):
        """The round's prompts (``rollout.prompts_per_round`` of them, drawn by the rollout seed) in units
        of ``rollout.prompts_per_unit``, plus the held-out evaluation unit where it is on."""
        rollout_cfg = self.cfg.rollout
        prompts = self.run.prompts("train")
        ids = round_prompt_ids([p["prompt_id"] for p in prompts], self.round, rollout_cfg.prompts_per_round, rollout_cfg.seed)
        units = [
            Unit(f"u{i // rollout_cfg.prompts_per_unit:05d}", prompt_ids=tuple(ids[i : i + rollout_cfg.prompts_per_unit]))
            for i in range(0, len(ids), rollout_cfg.prompts_per_unit)
        ]
        if rollout_cfg.eval_heldout and self.run.heldout_measure() != "none":
            units.append(HELDOUT_UNIT)
        return units, {"policy_version": self.version, "prompts": len(ids), "n": rollout_cfg.n}

    def setup(self):
        """The round's policy on its sampler (``rollout.backend``: a vLLM engine, kept or fresh, or the
        student's module), its tokenizer, stops, tools and rewards."""
        policy = self.run.policy_path(self.version)
        self.tok = load_tokenizer(policy)
        self.images = RunImages(self.run.fs)
        self.sampler = rollout_backend(self.cfg).open(self.run, self.version, self.live, self.tok)
        # Without answers only the rewards that read none are computed, and the run's reward may be None.
        self.rewards = run_rewards(self.cfg, self.run.has_answers("train"))
        self.stop_ids = stop_token_ids(self.tok, self.cfg.data)
        self.banned = unsampleable(policy)  # a VLM's image placeholders
        self.tool_use = ToolUse.from_config(self.cfg.rollout)
        self.guide = None
        if self.cfg.rollout.guided_fraction > 0:
            rollout_cfg, cross = self.cfg.rollout, self.cfg.score.cross_tokenizer
            teacher_path = self.run.teacher_folder(self.cfg.teacher)
            if not cross:
                check_same_tokenizer(policy, teacher_path)
            teacher = self.live.causal_lm(teacher_path, self.cfg.model, local_device(), fixed=True)
            self.guide = TeacherGuide(teacher, self.tok, load_tokenizer(teacher_path) if cross else None, self.cfg.data,
                                      min(rollout_cfg.guide_prefix_tokens, rollout_cfg.max_tokens - 1), rollout_cfg.temperature)

    def is_guided(self, prompt_id: str) -> bool:
        """A seeded, worker-independent choice of the round's guided prompts."""
        rollout_cfg = self.cfg.rollout
        u = sample_seed(rollout_cfg.seed, self.round, f"guide:{prompt_id}", 0) / 2**32
        return u < rollout_cfg.guided_fraction

    def sampling(self, seed: int, max_tokens: int, extra_stops: list[str], temperature: float | None = None) -> SamplingRequest:
        """One student turn's request: the run's sampling settings with this turn's seed (and
        ``temperature`` where given: 0 for a greedy held-out response)."""
        rollout_cfg = self.cfg.rollout
        return SamplingRequest(
            seed, max_tokens, rollout_cfg.temperature if temperature is None else temperature, rollout_cfg.top_p, rollout_cfg.top_k,
            stop=(*rollout_cfg.stop, *extra_stops), keep_stop_text=bool(extra_stops), stop_token_ids=tuple(self.stop_ids), banned=self.banned,
        )

    def run_unit(self, unit, out_dir):
        """``rollout.n`` rewarded responses (conversations, with tools) per prompt of ``unit``, as one
        rollout shard; the evaluation unit decodes the held-out prompts greedily instead."""
        if not unit.is_work:
            return self._eval_unit(out_dir)
        rollout_cfg = self.cfg.rollout
        by_id = {p["prompt_id"]: p for p in self.run.prompts("train")}
        conversations, meta = [], []
        for pid in unit.prompt_ids:
            prompt = by_id[pid]
            rendered = render_prompt(self.tok, prompt, self.cfg.data)
            guided = self.guide is not None and self.is_guided(pid)
            pictures = [self.images.get(i) for i in rendered.images]
            for s in range(rollout_cfg.n):
                c = Conversation(prompt, rendered.token_ids, sample_seed(rollout_cfg.seed, self.round, pid, s), pictures)
                if guided:
                    c.add_prefix(*self.guide.prefix(prompt, rendered.token_ids, c.seed))
                conversations.append(c)
                meta.append((rendered.text, s))
        self.generate(conversations, f"rollout r{self.round} {unit.id}", self.sampling)
        crash_point("rollout.generate")
        rows = [self.row(c, text, s) for c, (text, s) in zip(conversations, meta)]
        record = write_shard(self.run.fs, f"{out_dir}/part-00000.parquet", rows_table(rows, ROLLOUT_SCHEMA))
        rewarded = [r.reward for r in rows if r.reward is not None]
        return [record], RolloutNumbers(
            prompts=len(unit.prompt_ids), responses=len(rows), tokens=sum(len(r.response_token_ids) for r in rows),
            **({"reward_sum": sum(rewarded)} if rewarded else {}),
            **conversation_counts(rows), **(self.live.probe or {}), engine_dtype_bits=self.sampler.dtype_bits,
        )

    def generate(self, conversations: list[Conversation], label: str, sampling) -> None:
        """Write ``conversations`` to their ends on the engine (``sampling``: :meth:`sampling` or a
        variant), with a progress bar: a unit can take minutes, so its own progress moves as responses
        finish inside the sampler's loop; with tools a generation ends a turn, not a response, and those count
        when their conversation ends."""
        with progress.task(label, total=len(conversations), unit="responses", transient=True) as bar:
            def turn_done(ended: list) -> None:
                if self.tool_use is not None:
                    bar.advance(len(ended))
                bar.show(tokens=sum(len(c.response_ids) for c in conversations))

            run_conversations(self.sampler, self.tok, conversations, self.cfg.data, self.tool_use, self.cfg.rollout.max_tokens, sampling,
                              on_turn=turn_done, on_finished=None if self.tool_use is not None else bar.advance)

    def row(self, c: Conversation, prompt_text: str, sample_idx: int, rewards: dict | None = None) -> RolloutRow:
        """The stored row of one finished conversation, rewarded by ``rewards`` (default: the run's)."""
        rollout_cfg = self.cfg.rollout
        pid = c.row["prompt_id"]
        prefix_len = len(c.response_ids) - sum(c.loss_mask) if self.guide is not None else 0
        return RolloutRow(
            rollout_id=f"r{self.round:04d}-{pid}-{sample_idx:03d}", prompt_id=pid, sample_idx=sample_idx,
            round=self.round, policy_version=self.version,
            prompt_token_ids=c.prompt_ids, response_token_ids=c.response_ids, loss_mask=c.loss_mask, teacher_prefix_len=prefix_len,
            # Tokens the student did not sample (a teacher prefix, tool turns) carry 0 here.
            sampler_logprobs=c.sampler_logprobs,
            finish_reason=c.finish_reason, num_turns=c.num_turns, tool_calls=c.tool_calls,
            **self.rewarded(c, self.rewards if rewards is None else rewards),
            temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k, max_tokens=rollout_cfg.max_tokens,
            seed=c.seed, logprobs_mode="raw",
            # With tools the special tokens stay, so the stored text shows where each turn begins.
            prompt=prompt_text, response=self.tok.decode(c.response_ids, skip_special_tokens=self.tool_use is None),
        )

    def rewarded(self, c: Conversation, rewards: dict) -> dict:
        values = score_response(rewards, c.student_text(self.tok), c.row)
        return {"reward": values.get(self.cfg.reward), "rewards": values}

    def _eval_unit(self, out_dir):
        if self.run.heldout_measure() == "label_free":
            return self._label_free_eval_unit(out_dir)
        task = HeldoutTask(self.run.prompts("heldout"), get_reward(self.cfg.reward), self.cfg.rollout.max_tokens, self.cfg.data, self.tool_use, self.images)
        result = greedy_eval(self.sampler, self.tok, task)
        record = write_shard(self.run.fs, f"{out_dir}/eval.parquet", result.pop("table"), kind=FileKind.HELDOUT_ACCURACY)
        return [record], RolloutNumbers(eval=HeldoutFigures(**result))

    def _label_free_eval_unit(self, out_dir):
        """Held-out prompts without answers: each prompt's greedy response (sample 0) and one sampled at
        the run's temperature (sample 1), stored as rollout rows for score's teacher to read (the
        held-out reverse-KL estimate and the teacher's log-prob of the greedy answer)."""
        heldout = self.run.prompts("heldout")
        rows, answer_free = [], run_rewards(self.cfg, with_answers=False)
        rendered = [render_prompt(self.tok, prompt, self.cfg.data) for prompt in heldout]
        for sample_idx, temperature in enumerate((0.0, self.cfg.rollout.temperature)):
            conversations = [Conversation(prompt, r.token_ids, sample_seed(self.cfg.rollout.seed, self.round, f"heldout:{prompt['prompt_id']}", sample_idx))
                             for prompt, r in zip(heldout, rendered)]
            self.generate(conversations, f"rollout r{self.round} held-out", partial(self.sampling, temperature=temperature))
            rows += [dataclasses.replace(self.row(c, r.text, sample_idx, answer_free), temperature=temperature) for c, r in zip(conversations, rendered)]
        record = write_shard(self.run.fs, f"{out_dir}/part-00000.parquet", rows_table(rows, ROLLOUT_SCHEMA), kind=FileKind.HELDOUT_ROLLOUTS)
        return [record], RolloutNumbers(eval=HeldoutFigures(label_free=True, n=len(heldout)))

    def summarize(self, commits: list[Commit[RolloutNumbers]]) -> dict:
        """The manifest's metrics: responses, tokens, rewards, speed, the held-out score, tool use."""
        gen = [c.numbers for c in commits if c.is_work]  # each sampling unit's own numbers
        responses = sum(c.responses for c in gen)
        metrics = {
            "policy_version": self.version,
            "staleness": self.round - self.version,  # rounds the sampling policy is behind the round's
            "responses": responses,
            "tokens": sum(c.tokens for c in gen),
            "reward_mean": sum(c.reward_sum for c in gen) / max(responses, 1) if all(c.reward_sum is not None for c in gen) else None,
            "seconds": sum(c.numbers.seconds for c in commits),
            **conversation_metrics(gen, responses),
        }
        metrics["tokens_per_s"] = metrics["tokens"] / max(sum(c.seconds for c in gen), 1e-9)
        # The engine probe (gndpo.stages.models.probe): the worst gap of any worker's engine this round;
        # the engine's precision: the least precise of any worker's.
        if any(c.engine_dtype_bits is not None for c in gen):
            metrics["engine_dtype_bits"] = min(c.engine_dtype_bits for c in gen if c.engine_dtype_bits is not None)
        for key in ("engine_probe_gap_max", "engine_probe_gap_mean", "engine_reloaded", "engine_restarted", "engine_adapters"):
            measured = [getattr(c, key) for c in gen if getattr(c, key) is not None]
            if measured:
                metrics[key] = max(measured)
        for c in commits:
            if not c.is_work and c.numbers.eval.accuracy is not None:
                metrics["heldout_accuracy"] = c.numbers.eval.accuracy
        return metrics
