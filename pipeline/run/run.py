"""A run as the stages see it: the frozen config, each stage's records, and where each round's policy and
teachers are. Creating a run (and every check it makes first) is :mod:`gndpo.apps.init`."""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.run.images import image_ids
from gndpo.pipeline.run.products import POLICY, ROLLOUTS, ROUND, PolicyExport, Product, TrainNumbers, policy_export
from gndpo.pipeline.run.teacher_runs import is_reference, teacher_folder
from gndpo.pipeline.settings.schema import SELF_TEACHER, Config
from gndpo.pipeline.tasks.plugins import use_plugin_dirs
from gndpo.storage.cache import cache_dir
from gndpo.storage.hub import hub_snapshot
from gndpo.storage.products import FileRecord, N, UnitNumbers
from gndpo.storage.records import InheritedRecords, StageRecords, round_prefix
from gndpo.storage.runfs import RunFS
from gndpo.storage.tables import read_prompt_table

PROMPT_SPLITS = ("train", "heldout")


@dataclass
class Run:
    """An opened run folder: its storage, its frozen config, and where each round's records, policy
    and teachers are (a fork's inherited rounds included). What every stage and command is given."""

    fs: RunFS
    cfg: Config
    # A forked run (`gndpo fork`): {"parent": URL, "from_round": K}. Its rounds before K, and round K's
    # rollouts, are the parent's committed records, read where they are.
    lineage: dict | None = None
    # Teachers that are another run's policy ({"run:...": resolution}, pipeline.run.teacher_runs),
    # resolved once by `gndpo init`.
    teacher_runs: dict | None = None
    # Models named by hub id ({"org/name[@rev]": {id, revision, commit}}, gndpo.storage.hub), resolved
    # once by `gndpo init`: every process loads that commit, whatever the revision names since.
    hub_models: dict | None = None
    # Served teachers' answers to the probe when the run was created ({teacher name: log-probs},
    # score.backend server): every score worker holds the servers to them.
    served_probes: dict | None = None

    def records(self, round_idx: int, product: Product[N] | str) -> StageRecords[N]:
        """The records (plan, claims, done markers, manifest) of the stage that makes ``product`` in
        round ``round_idx``, its units' numbers typed (a stage given by its folder's name alone reads the
        executor's numbers only): the parent's, read where they are, for a round a fork inherits."""
        stage, numbers = (product.stage, product.numbers) if isinstance(product, Product) else (product, UnitNumbers)
        if self.lineage and self.inherits(round_idx, stage):
            return InheritedRecords(RunFS(self.lineage["parent"], self.fs.storage_options), round_idx, stage, numbers)
        return StageRecords(self.fs, round_idx, stage, numbers)

    def round_stages(self, round_idx: int) -> list[str]:
        """The stages of round ``round_idx`` in the order they run: the four of every round
        (:data:`gndpo.pipeline.run.products.ROUND`), then any other stage the run's folder holds for it
        (a stage added to the registry), by name."""
        made = [product.stage for product in ROUND]
        return made + sorted(set(self.fs.listdir(round_prefix(round_idx))) - set(made))

    def inherits(self, round_idx: int, stage: str) -> bool:
        """Whether this (forked) run takes ``stage`` of ``round_idx`` from its parent: every stage of the
        rounds before the fork, and the fork's first round's rollouts."""
        k = self.lineage["from_round"] if self.lineage else -1
        return round_idx < k or (round_idx == k and stage == ROLLOUTS.stage)

    def prompts(self, split: str) -> list[dict]:
        """The prompt table init imported for ``split`` ("train" or "heldout"), one dict per row."""
        return read_prompt_table(self.fs, f"prompts/{split}.parquet")

    def has_answers(self, split: str) -> bool:
        """Whether every prompt of ``split`` has a reference answer (a prompts file without an answer
        column has none: on-policy distillation needs no labels)."""
        rows = self.prompts(split)
        return bool(rows) and all(r.get("answer") is not None for r in rows)

    def heldout_measure(self) -> str:
        """What each round measures on the held-out prompts: ``accuracy`` (the greedy response's reward)
        where they have answers; else ``label_free`` (the reverse-KL estimate on a sampled response and
        the teacher's log-prob of the greedy one, which score computes) where the teacher reads a
        held-out prompt as the student does; else ``none`` (no held-out prompts, or a teacher context,
        a teacher of another tokenizer, routed teachers or pictures: those prompts are built from the
        training rows)."""
        if not self.prompts("heldout"):
            return "none"
        if self.has_answers("heldout"):
            return "accuracy"
        cfg = self.cfg
        routed = bool(cfg.teachers) and cfg.score.teacher_mix == "route"
        if cfg.teacher_context.messages or cfg.score.cross_tokenizer or routed or self.images_per_prompt():
            return "none"
        return "label_free"

    def images_per_prompt(self) -> int:
        """The most images one prompt of the run shows (0: a text-only run)."""
        return max((len(image_ids(p)) for split in PROMPT_SPLITS for p in self.prompts(split)), default=0)

    def policy_path(self, round_idx: int) -> str:
        """A local folder with the student that rolls out ``round_idx``: the config's student for round
        0, else the model exported by the previous round's train stage (downloaded if remote)."""
        if round_idx == 0:
            return self.model_folder(self.cfg.student, "student")
        records = self.records(round_idx - 1, POLICY)  # a forked run's early rounds live in its parent
        require_exported(records)
        return records.run.local_dir(self.policy_dir(round_idx), model_cache_dir())

    def sampling_version(self, round_idx: int) -> int:
        """The policy version that samples round ``round_idx``: the student after max(round -
        run.max_staleness, 0) trained rounds (the round's own index at staleness 0)."""
        return max(round_idx - self.cfg.run.max_staleness, 0)

    def lora_base(self) -> str | None:
        """With model.lora, the initial student the rounds' adapters apply to; else None."""
        return self.policy_path(0) if self.cfg.model.lora.enabled else None

    def policy_dir(self, round_idx: int) -> str | None:
        """The run-relative folder of the model exported by round ``round_idx - 1`` (None for round 0)."""
        if round_idx == 0:
            return None
        return self.exported(round_idx).model_dir

    def exported(self, round_idx: int) -> PolicyExport:
        """What round ``round_idx - 1``'s train exported: the policy round ``round_idx`` starts from."""
        return policy_export(self.records(round_idx - 1, POLICY).require_manifest())

    def teacher_models(self, round_idx: int) -> dict[str, str]:
        """{name recorded per score row: local model folder} of the teachers that score ``round_idx``:
        the config's, or with ``teacher: self`` the student's weights ``self_teacher.weights`` names
        (frozen: the initial student; live: the policy that sampled the round; ema: the average train
        exported with that policy, the initial student at version 0)."""
        if self.cfg.teacher != SELF_TEACHER:
            return {name: self.teacher_folder(value) for name, value in self.cfg.teacher_models().items()}
        weights = self.cfg.self_teacher.weights
        # The sampling policy, not the newest: a stale round's score may run before the newer one exists.
        version = self.sampling_version(round_idx)
        if weights == "frozen" or version == 0:
            path = self.policy_path(0)
        elif weights == "live":
            path = self.policy_path(version)
        else:
            records = self.records(version - 1, POLICY)
            require_exported(records)
            path = records.run.local_dir(self.exported(version).ema_dir, model_cache_dir())
        return {f"self/{weights}": path}

    def model_folder(self, name: str, role: str = "model") -> str:
        """The local folder of a configured model (``name`` as the config writes it): a folder as it is,
        or for a hub id the snapshot of the commit this run was created with."""
        record = (self.hub_models or {}).get(name)
        return hub_snapshot(record, role) if record else name

    def teacher_folder(self, teacher: str) -> str:
        """The local folder of a configured teacher: its folder or hub snapshot (:meth:`model_folder`),
        or for ``run:...`` the other run's policy this run was created with (downloaded if remote)."""
        if not is_reference(teacher):
            return self.model_folder(teacher, "teacher")
        resolution = (self.teacher_runs or {}).get(teacher)
        if resolution is None:
            raise GndpoError(f"teacher {teacher} was not resolved when {self.fs.url} was created (run.yaml has no teacher_runs entry for it); "
                             "create the run with `gndpo init`")
        return teacher_folder(teacher, resolution, model_cache_dir(), self.fs.storage_options)

    def teacher_changes(self) -> bool:
        """Whether the teacher's weights differ from round to round (a self-teacher that follows the student)."""
        return self.cfg.teacher == SELF_TEACHER and self.cfg.self_teacher.weights != "frozen"

    def newest_policy_version(self) -> int:
        """The newest committed student's version: how many rounds have trained."""
        version = 0
        while self.records(version, POLICY).manifest() is not None:
            version += 1
        return version

    def committed_policy(self, version: int | None = None) -> "CommittedPolicy":
        """Trained policy ``version`` (the student after that many trained rounds; None: the newest) as
        its train stage committed it. One-line errors for a run with no trained policy yet, a version it
        does not have, and a policy `gndpo gc --keep-rounds` removed."""
        newest = self.newest_policy_version()
        if newest == 0:
            raise GndpoError(f"{self.fs.url} has no trained policy yet (no round's train has committed)")
        version = newest if version is None else version
        if not 1 <= version <= newest:
            trained = "v1" if newest == 1 else f"v1 to v{newest}"
            raise GndpoError(f"{self.fs.url} has no policy v{version}; its trained policies are {trained} (v0 is the initial student)")
        records = self.records(version - 1, POLICY)
        require_exported(records)
        return CommittedPolicy(version, records, policy_export(records.require_manifest()))

    def latest_policy(self) -> tuple[int, str]:
        """(policy version, local path) of the newest committed student."""
        version = self.newest_policy_version()
        return version, self.policy_path(version)


@dataclass(frozen=True)
class CommittedPolicy:
    """A trained policy where its train stage committed it."""

    version: int  # the student after this many trained rounds
    records: StageRecords[TrainNumbers]  # round version - 1's train records, in the run that holds them (a fork's parent's)
    export: PolicyExport  # the export's folder and files, relative to that run

    @property
    def model_dir(self) -> str:
        return self.export.model_dir

    @property
    def files(self) -> list[FileRecord]:
        return self.export.files


def require_exported(records: StageRecords) -> None:
    """Refuse, in one line, to read what a train stage exported once `gndpo gc --keep-rounds` removed it."""
    if records.pruned() is not None:
        raise GndpoError(f"round {records.round}'s exported policy and optimizer state were removed by `gndpo gc --keep-rounds` "
                         f"({records.run.url}); use a newer round's")


def model_cache_dir() -> str:
    """The local folder where engines keep copies of models read from object storage."""
    return str(cache_dir("models"))


def open_run(url: str) -> Run:
    """The run at ``url`` (any fsspec URL) with its frozen config; a one-line GndpoError where the
    folder holds no run or its run.yaml does not read."""
    fs = RunFS(url)
    if not fs.exists("run.yaml"):
        raise GndpoError(f"not a gndpo run (no run.yaml): {url}; create it with `gndpo init`")
    try:
        data = yaml.safe_load(fs.read_bytes("run.yaml"))
    except yaml.YAMLError:
        raise GndpoError(f"corrupt run.yaml in {url}") from None
    lineage = data.pop("lineage", None) if isinstance(data, dict) else None
    teacher_runs = data.pop("teacher_runs", None) if isinstance(data, dict) else None
    hub_models = data.pop("hub_models", None) if isinstance(data, dict) else None
    served_probes = data.pop("served_probes", None) if isinstance(data, dict) else None
    if isinstance(data, dict):  # the run's own plugins import in every process that opens it
        use_plugin_dirs(data.get("plugin_dirs") or [])
    return Run(fs=fs, cfg=config_from_dict(data), lineage=lineage, teacher_runs=teacher_runs, hub_models=hub_models,
               served_probes=served_probes)
