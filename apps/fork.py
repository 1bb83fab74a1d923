"""`gndpo fork`: a new run that replays a committed round of another run with other settings.

``fork_run(RUN, NEW, K, overrides)`` creates NEW from RUN's config plus ``overrides``. NEW's rounds
before K and round K's rollouts are RUN's committed records, read in RUN's folder (never copied: every
file record NEW reads carries RUN's URL and its sha256 is checked as always), so NEW's first stage to
compute is round K's score: the same responses scored again with another teacher, method or
normalization. The lineage (RUN's URL, K, RUN's config fingerprint) is recorded in NEW's run.yaml.

What round K's rollouts were sampled with cannot change (the student, data, rollout and engine
sections, and the policy version ``run.max_staleness`` names for round K), and every reward NEW uses
must be one RUN recorded per response; both are refused in one line. The rest is validated as ``gndpo
init`` validates it.
"""

from __future__ import annotations

import os
from dataclasses import replace

import yaml

from gndpo.apps.init import check_images, check_models, check_precision, check_routes, check_teacher_prompts, resolve_models, run_yaml
from gndpo.errors import GndpoError
from gndpo.pipeline.config.checks import check_staleness
from gndpo.pipeline.config.load import apply_overrides, config_from_dict
from gndpo.pipeline.methods import validate as validate_method
from gndpo.pipeline.run.images import RunImages, copy_images
from gndpo.pipeline.run.products import POLICY, ROLLOUTS
from gndpo.pipeline.run.run import PROMPT_SPLITS, Run, open_run
from gndpo.pipeline.settings.schema import Config
from gndpo.pipeline.tasks.rewards import run_rewards
from gndpo.stages.models.loading import read_once
from gndpo.stages.samplers.registry import check_rollout_backend
from gndpo.stages.teachers.registry import backend_of, check_teacher_backend
from gndpo.stages.teachers.served import served_models, teacher_server_settings
from gndpo.storage.runfs import RunFS

# What a round's rollouts depend on besides the seeds: a fork keeps them as they were.
ROLLOUT_SECTIONS = ("student", "data", "rollout", "engine")


def _absolute(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


def fork_refusal(parent_url: str, from_round: int, cfg: Config) -> str | None:
    """Why a run with ``cfg`` cannot fork ``parent_url`` at ``from_round`` (its rollouts of that round are
    not committed, a setting they were sampled with differs, a reward ``cfg`` uses was not recorded), as
    the one-line message :func:`fork_run` refuses with; None when it can. For a caller that forks where
    the settings allow and otherwise starts afresh (``gndpo compare``'s methods after the first). A
    parent that is not a run folder is not a reason: it raises, as it would from :func:`fork_run`."""
    parent = open_run(parent_url)
    if from_round < 0 or parent.records(from_round, ROLLOUTS).manifest() is None:
        return f"cannot fork {parent_url} at round {from_round}: its rollout of round {from_round} is not committed"
    if from_round > 0 and parent.records(from_round - 1, POLICY).pruned() is not None:
        return (f"cannot fork {parent_url} at round {from_round}: the policy that sampled it (round {from_round - 1}'s export) "
                "was removed by `gndpo gc --keep-rounds`")
    for section in ROLLOUT_SECTIONS:
        if getattr(cfg, section) != getattr(parent.cfg, section):
            return f"fork: {section} cannot change: round {from_round}'s rollouts were sampled with {parent_url}'s {section}"
    # Round K's score takes the student's column (train's behaviour log-probs) from the policy the fork's
    # run.max_staleness says sampled K: it must be the one that did, or every ratio divides by another policy.
    sampled, version = parent.sampling_version(from_round), replace(parent, cfg=cfg).sampling_version(from_round)
    if version != sampled:
        return (f"fork: run.max_staleness {cfg.run.max_staleness} would score round {from_round} as sampled by policy {version}, "
                f"but {parent_url}'s rollouts of it were sampled by policy {sampled} (run.max_staleness {parent.cfg.run.max_staleness})")
    recorded = set(run_rewards(parent.cfg))
    missing = [name for name in (cfg.reward, *cfg.method.outcome.rewards) if name not in recorded]
    if missing:
        return f"fork: {parent_url}'s rollouts did not record the reward(s) {', '.join(missing)}"
    return None


def fork_run(parent_url: str, url: str, from_round: int, overrides: list[str] = (), cfg: Config | None = None) -> Run:
    """Create (or, with the same settings, reopen) the fork ``url`` of ``parent_url`` at ``from_round``,
    with the parent's config plus ``overrides``, or with ``cfg`` as a whole."""
    parent = open_run(parent_url)
    if cfg is None:
        cfg = config_from_dict(apply_overrides(parent.cfg.to_dict(), list(overrides)))
    refusal = fork_refusal(parent_url, from_round, cfg)
    if refusal:
        raise GndpoError(refusal)
    models = resolve_models(cfg, parent.teacher_runs, parent.hub_models)
    local = models.local  # the checks read the models' local folders
    validate_method(local.method)
    check_staleness(local)
    check_teacher_backend(local)
    check_precision(local)
    with read_once():  # the checks read the same models' tokenizers and configs several times
        check_models(local)
        check_routes(local, parent.prompts("train"))
        check_images(local, parent.images_per_prompt() > 0)
        check_rollout_backend(local, parent.images_per_prompt() > 0)
        check_teacher_prompts(local, parent.prompts("train"), RunImages(parent.fs).get)
        probes = backend_of(cfg).check_teachers(cfg, local, parent.images_per_prompt() > 0, kept_probes(parent, cfg))
    lineage = {"parent": _absolute(parent.fs.url), "from_round": from_round, "parent_fingerprint": parent.cfg.fingerprint()}
    body = run_yaml(cfg, models, lineage=lineage, **({"served_probes": probes} if probes else {}))
    fs = RunFS(url)
    if fs.exists("run.yaml"):
        return _reopen(url, body)
    # The parent's imported prompts and pictures, so prompt ids and rows are the same.
    copy_images(parent.fs, fs, [row for split in PROMPT_SPLITS for row in parent.prompts(split)])
    for split in PROMPT_SPLITS:
        fs.write_new(f"prompts/{split}.parquet", parent.fs.read_bytes(f"prompts/{split}.parquet"))
    if not fs.create("run.yaml", body):
        return _reopen(url, body)
    return open_run(url)


def without_probes(run_yaml_bytes: bytes) -> dict:
    data = yaml.safe_load(run_yaml_bytes)
    data.pop("served_probes", None)
    return data


def kept_probes(parent: Run, cfg: Config) -> dict:
    """The parent's record of its served teachers' answers, for each teacher the fork keeps (the same
    model, served under the same name): the fork's workers hold its servers to the teacher the parent
    began with."""
    if not (parent.served_probes and backend_of(parent.cfg).capabilities.served and backend_of(cfg).capabilities.served):
        return {}
    same = {name for name, model in served_models(cfg).items() if served_models(parent.cfg).get(name) == model}
    parent_names, names = teacher_server_settings(parent.cfg), teacher_server_settings(cfg)
    return {name: probe for name, probe in parent.served_probes.items()
            if name in same and name in names and names[name].model == parent_names[name].model}


def _reopen(url: str, body: bytes) -> Run:
    fs = RunFS(url)
    # The served teachers' answers are measured again by each call: a run is the same without them.
    if without_probes(fs.read_bytes("run.yaml")) != without_probes(body):
        raise GndpoError(f"run folder {url} already exists with other settings; use a new folder")
    return open_run(url)
