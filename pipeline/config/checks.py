"""Checks of settings against each other: those no one key can declare (:func:`check_combinations`,
whenever a config is read), and those that need the methods' declarations (what each method's score
columns are), run by ``gndpo init`` and ``gndpo fork``; never again by a stage."""

from __future__ import annotations

import httpx

from gndpo.errors import GndpoError
from gndpo.pipeline.methods import policy_settings, score_needs
from gndpo.pipeline.methods.base import STUDENT_ENTROPY, TEACHER_ENTROPY, TOKEN_KL, TOPK
from gndpo.pipeline.settings.schema import SELF_TEACHER, Config


def check_other_vocabulary(cfg: Config) -> None:
    """A GndpoError (one line) for what ``score.cross_tokenizer`` cannot give the run's method: values
    defined at every position over one vocabulary (the teacher's entropy, the full KL); a top-k mixed
    over several teachers (each sits at its own spans' first tokens); the renormalized top-k form."""
    needs = score_needs(cfg.method)
    one_vocabulary = sorted(needs & {TEACHER_ENTROPY, TOKEN_KL})
    if one_vocabulary:
        raise GndpoError(
            f"score.cross_tokenizer compares the teacher's top-k token by token text; method {cfg.method.name} also needs "
            f"{', '.join(one_vocabulary)}, defined at every position over one vocabulary: use a teacher with the student's tokenizer"
        )
    if TOPK in needs and cfg.teachers and cfg.score.teacher_mix == "mean":
        raise GndpoError("score.teacher_mix mean with score.cross_tokenizer mixes sampled-token log-probs only: each teacher's "
                         "top-k sits at its own spans' first tokens, in its own vocabulary; route each prompt to one teacher "
                         "(score.teacher_mix route) for a top-k method")
    if TOPK in needs and cfg.method.topk_form != "bucket":
        raise GndpoError("score.cross_tokenizer compares top-k divergences in method.topk_form bucket only (the teacher's "
                         "tokens without a student twin join its rest bucket)")


def engine_logprob_blockers(cfg: Config) -> list[str]:
    """Why the rollout engine's sampler log-probs cannot stand in for the student's forward in score
    (empty: they can): they are the temperature-1 distribution's, exist only for tokens the student
    sampled, and are not the student's whole distribution."""
    rollout_cfg = cfg.rollout
    reasons = [
        (rollout_cfg.temperature != 1.0, f"rollout.temperature {rollout_cfg.temperature} (vLLM returns the temperature-1 distribution's log-probs)"),
        (bool(rollout_cfg.tools), "rollout.tools (tool turns are not sampled by the student)"),
        (rollout_cfg.guided_fraction > 0, "rollout.guided_fraction (a guided prefix is not sampled by the student)"),
        (bool(score_needs(cfg.method) & {STUDENT_ENTROPY, TOKEN_KL}), f"method {cfg.method.name} (it reads the student's distribution)"),
    ]
    return [why for clash, why in reasons if clash]


def check_student_logprobs(cfg: Config) -> None:
    """A GndpoError (one line) when ``score.student_logprobs: engine`` cannot stand in for the student's
    forward (:func:`engine_logprob_blockers`); ``auto`` falls back to the forward there instead."""
    blockers = engine_logprob_blockers(cfg) if cfg.score.student_logprobs == "engine" else []
    if blockers:
        raise GndpoError(f"score.student_logprobs engine cannot be used with {blockers[0]}: use score.student_logprobs recompute or auto")


def check_combinations(cfg: Config) -> None:
    """The checks no one key can declare: empty strings in lists, and settings that contradict each other."""
    rollout_cfg = cfg.rollout
    if not all(rollout_cfg.stop):
        raise GndpoError(f"config key rollout.stop must be a list of non-empty strings, got {rollout_cfg.stop!r}")
    if cfg.teachers:
        if cfg.teacher:
            raise GndpoError("config names both teacher and teachers; name one teacher, or several under teachers")
        if len(cfg.teachers) < 2 or not all(k and v for k, v in cfg.teachers.items()):
            raise GndpoError(f"config key teachers must map two or more names to model paths, got {cfg.teachers!r}")
        if cfg.score.backend == "vllm":
            raise GndpoError("several teachers are scored with score.backend hf or server only (one teacher per vLLM engine is not built yet)")
    check_self_distillation(cfg)
    check_servers(cfg)
    check_lora(cfg)
    if cfg.score.teacher_end_text and not cfg.score.cross_tokenizer:
        raise GndpoError("score.teacher_end_text is for a teacher of another tokenizer (score.cross_tokenizer true)")
    if cfg.method.stats_scope == "teacher" and not (cfg.teachers and cfg.score.teacher_mix == "route"):
        raise GndpoError("method.stats_scope teacher needs several teachers routed by prompt (teachers, score.teacher_mix route)")
    if not all(rollout_cfg.tools):
        raise GndpoError(f"config key rollout.tools must be a list of tool names (built-in or module:function), got {rollout_cfg.tools!r}")
    if rollout_cfg.tools and rollout_cfg.guided_fraction > 0:
        raise GndpoError("config keys rollout.tools and rollout.guided_fraction cannot be combined: guidance writes one turn's prefix")
    if rollout_cfg.top_k == 0:
        raise GndpoError("config key rollout.top_k must be -1 (off) or >= 1, got 0")
    if rollout_cfg.guided_fraction > 0 and rollout_cfg.guide_prefix_tokens >= rollout_cfg.max_tokens:
        raise GndpoError(
            f"config key rollout.guide_prefix_tokens ({rollout_cfg.guide_prefix_tokens}) must be below rollout.max_tokens "
            f"({rollout_cfg.max_tokens}) when rollout.guided_fraction > 0: the student must write part of each response"
        )


def server_url_problem(url) -> str:
    """What is wrong with a teacher server's URL as the HTTP client (httpx) parses it: its scheme, host
    and port; "" for a usable one."""
    if not isinstance(url, str):
        return f"a {type(url).__name__}, not text"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return str(exc)
    if parsed.scheme not in ("http", "https"):
        return f"scheme {parsed.scheme or 'missing'}, not http or https"
    if not parsed.host:
        return "no host"
    if "%" in parsed.host or any(c.isspace() for c in url):
        return "a space or an escaped character in it"
    if parsed.port is not None and not 0 < parsed.port < 65536:
        return f"port {parsed.port} is not 1-65535"
    return ""


def check_servers(cfg: Config) -> None:
    """``score.backend: server``'s settings: URLs for every teacher (a list for one, a mapping by name for
    several), a served self-teacher that does not change, no server settings for another backend."""
    score_cfg = cfg.score
    if score_cfg.backend != "server":
        if score_cfg.servers or score_cfg.server_model:
            raise GndpoError(f"score.servers and score.server_model are for score.backend server, not {score_cfg.backend}")
        return
    names = list(cfg.teachers) if cfg.teachers else []
    if names and not (isinstance(score_cfg.servers, dict) and set(score_cfg.servers) == set(names)):
        raise GndpoError(f"score.servers must map each teacher ({', '.join(names)}) to its servers' URLs, got {score_cfg.servers!r}")
    if not names and not (isinstance(score_cfg.servers, list) and score_cfg.servers):
        raise GndpoError(f"score.backend server needs the teacher's servers as a list of URLs in score.servers, got {score_cfg.servers!r}")
    if isinstance(score_cfg.server_model, dict) and not set(score_cfg.server_model) <= set(names):
        raise GndpoError(f"score.server_model names teachers the run does not have: {', '.join(sorted(set(score_cfg.server_model) - set(names)))}")
    for urls in score_cfg.servers.values() if isinstance(score_cfg.servers, dict) else [score_cfg.servers]:
        for url in urls:
            problem = server_url_problem(url)
            if problem:
                raise GndpoError(f"score.servers: {url!r} is not a URL ({problem}): write http://host:port or https://host:port")
    if cfg.teacher == SELF_TEACHER and cfg.self_teacher.weights != "frozen":
        raise GndpoError(f"score.backend server serves fixed weights; self_teacher.weights {cfg.self_teacher.weights} changes them every "
                         "round: use self_teacher.weights frozen (the servers serve the initial student)")


def check_lora(cfg: Config) -> None:
    """``model.lora`` with what it is not built for yet: an EMA self-teacher (an average of the merged
    weights)."""
    if not cfg.model.lora.enabled:
        return
    if not cfg.model.lora.target_modules or not all(cfg.model.lora.target_modules):
        raise GndpoError("config key model.lora.target_modules must name modules (or all-linear)")
    if cfg.teacher == SELF_TEACHER and cfg.self_teacher.weights == "ema":
        raise GndpoError("model.lora cannot be combined with self_teacher.weights ema (the average of merged weights is not built yet)")


def check_self_distillation(cfg: Config) -> None:
    """``teacher: self`` and ``teacher_context``: combinations that cannot work, and turns whose content
    is not a format string over column names."""
    if cfg.teacher == SELF_TEACHER:
        for other, clash in (("teachers", bool(cfg.teachers)), ("score.cross_tokenizer", cfg.score.cross_tokenizer),
                             ("rollout.guided_fraction", cfg.rollout.guided_fraction > 0)):
            if clash:
                raise GndpoError(f"teacher: self (self-distillation) cannot be combined with {other}")
        if cfg.self_teacher.weights == "ema" and cfg.train.zero_stage == 3:
            raise GndpoError("self_teacher.weights ema keeps the average on each rank: use train.zero_stage 0-2")
    try:
        names = cfg.teacher_context.columns()
    except ValueError as exc:  # an unmatched brace
        raise GndpoError(f"config key teacher_context.messages: {exc}") from None
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise GndpoError(f"config key teacher_context.messages: {{{bad[0]}}} is not a column name (write {{{{ and }}}} for literal braces)")
    if cfg.teacher_context.other_problem and not cfg.teacher_context.messages:
        raise GndpoError("teacher_context.other_problem needs teacher_context.messages (the context to take from another prompt)")


# The policy losses whose ratio exp(logp - old_logp) weighs each sampled token by how much likelier the
# trained policy makes it than the policy that sampled it (old_logp: the behaviour's, stored per row).
CORRECTED_LOSSES = ("gspo", "ppo", "is")
NO_POLICY_GRADIENT = "none"  # a divergence alone, computed in train against the current student


def check_staleness(cfg: Config) -> None:
    """A GndpoError (one line) when ``run.max_staleness`` > 0 meets a policy-gradient loss that trains as
    if the policy that sampled were the one trained: no importance ratio against the behaviour's
    log-probs (reinforce's -A log pi). A divergence alone (``none``) is accepted: train computes it at
    each stored state against the current student, so nothing in it is the sampling policy's; staleness
    changes only which states were visited, which no loss here corrects (docs/concepts/methods.md)."""
    if not cfg.run.max_staleness:
        return
    loss, _ = policy_settings(cfg.method)
    if loss not in (*CORRECTED_LOSSES, NO_POLICY_GRADIENT):
        raise GndpoError(
            f"run.max_staleness {cfg.run.max_staleness} trains on samples of an older policy, and method {cfg.method.name} has policy loss {loss}, "
            f"with no importance ratio against the sampling policy: set method.policy_loss to one of {', '.join(CORRECTED_LOSSES)}, "
            "or run.max_staleness 0")
