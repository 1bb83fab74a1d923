"""Creating a run: ``init_run`` validates everything before writing anything (config, model paths,
tokenizers, precision and attention names, prompt files, and that the longest prompt plus
``rollout.max_tokens`` fits the engine's context), then writes the prompts and, last, ``run.yaml`` with
exclusive create. A run folder therefore either has a complete ``run.yaml`` or is not a run;
re-initialising it with the same config is a no-op and with another config is an error.

The checks that need a model (its tokenizer, chat template, context length) live here, above the stages
whose loaders they use; the checks of the settings alone are :mod:`gndpo.pipeline.config`'s.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

import polars as pl
import yaml
from transformers.utils import logging as hf_logging

from gndpo.apps.round_size import check_round_fits
from gndpo.apps.schedule import choose_order
from gndpo.errors import GndpoError
from gndpo.pipeline.config.checks import check_staleness
from gndpo.pipeline.config.load import config_to_yaml
from gndpo.pipeline.methods import answer_readers
from gndpo.pipeline.methods import validate as validate_method
from gndpo.pipeline.run.images import decode, image_ids, store_images, with_image_ids
from gndpo.pipeline.run.prompts import load_prompts, split_heldout
from gndpo.pipeline.run.run import PROMPT_SPLITS, Run, model_cache_dir, open_run
from gndpo.pipeline.run.teacher_runs import is_reference, parse_reference, resolve_reference, teacher_folder
from gndpo.pipeline.settings.schema import SELF_TEACHER, Config
from gndpo.pipeline.tasks.rewards import check_rewards
from gndpo.stages.models.device import flash_attention_blocker, gpu_memory, visible_gpus
from gndpo.stages.models.gpu_memory import check_gpu_memory, train_ranks
from gndpo.stages.models.loading import check_model_files, check_same_tokenizer, is_vision_model, load_tokenizer, read_once
from gndpo.stages.models.vision import expanded_prompt_ids, load_processor, same_image_processing
from gndpo.stages.models.vllm_engine import model_context_length, resolve_max_model_len
from gndpo.stages.samplers.registry import check_rollout_backend, rollout_backend
from gndpo.stages.teachers.registry import backend_of, check_teacher_backend
from gndpo.stages.text.agent import ToolUse
from gndpo.stages.text.chat import render_prompt, tool_turn_ids, uses_template
from gndpo.stages.text.teacher_context import TeacherPrompts
from gndpo.storage.hub import hub_snapshot, is_hub_id, resolve_hub_model
from gndpo.storage.runfs import RunFS
from gndpo.storage.tables import write_prompt_table


def configured_models(cfg: Config) -> dict[str, str]:
    """{role: model as the config names it} of every model a run reads: the student and its teachers
    (none of its own with ``teacher: self``)."""
    teachers = {} if cfg.teacher == SELF_TEACHER else {f"teachers.{n}": p for n, p in cfg.teachers.items()} or {"teacher": cfg.teacher}
    return {"student": cfg.student, **teachers}


def served_teachers(cfg: Config) -> set[str]:
    """The teachers (as the config names them) that ``score.backend: server`` scores through servers:
    their weights stay on the servers; a self-teacher's are the student's."""
    if not backend_of(cfg).capabilities.served or cfg.teacher == SELF_TEACHER:
        return set()
    return set(cfg.teacher_models().values())


def check_models(cfg: Config) -> None:
    """Every model exists and holds weights (a served teacher its config: its servers hold the weights),
    and the teachers share the student's tokenizer (fail fast: distillation over different
    vocabularies would compare log-probs of different tokens). ``cfg`` names local folders
    (:func:`resolve_models`)."""

    roles = configured_models(cfg)
    for role, path in roles.items():
        if not path:
            raise GndpoError(f"config has no {role} model path")
        if not Path(path).exists():
            raise GndpoError(f"{role} model path does not exist: {path} (a model is a local folder, a hub id org/name[@revision], "
                             "or for a teacher run:RUN[@K])")
        if role != "student" and path in served_teachers(cfg):
            if not (Path(path) / "config.json").is_file():
                raise GndpoError(f"{role}: not a model folder (no config.json): {path}")
            continue
        try:
            check_model_files(path)
        except GndpoError as exc:
            raise GndpoError(f"{role}: {exc}") from None
    if cfg.score.cross_tokenizer:  # log-probs are mapped by character offsets (gndpo.stages.text.align)
        return
    for role, path in roles.items():
        if role != "student":
            check_same_tokenizer(cfg.student, path)


def check_precision(cfg: Config) -> None:
    """Warn, in one line, where ``model.attn_implementation: flash_attention_2`` cannot run on this
    machine (flash-attn not installed, no CUDA GPU): stages that run where it cannot use sdpa instead,
    and a run is often created on a login node that the GPU nodes differ from. The names of dtypes and
    attention kernels are the schema's choices, checked when the config is read."""
    if cfg.model.attn_implementation == "flash_attention_2" and (reason := flash_attention_blocker()):
        logging.getLogger("gndpo").warning("model.attn_implementation flash_attention_2: %s here; a stage that runs where "
                                           "flash-attn cannot falls back to sdpa", reason)


def longest_prompt(model_path: str, rows: list[dict], data, images: dict[str, bytes]) -> tuple[int, int]:
    """(tokens, row index) of the longest prompt, rendered as rollout renders it (:func:`render_prompt`:
    the student's chat template and tokenizer) and, with images, with each image's tokens expanded as
    the model's processor expands them (without ``images``' bytes, each picture counts as its one
    placeholder token); a prompt the template cannot render is a GndpoError here."""

    tok = load_tokenizer(model_path)
    processor = load_processor(model_path) if images else None

    def length(row: dict) -> int:
        rendered = render_prompt(tok, row, data)
        if not image_ids(row) or not images:
            return len(rendered.token_ids)
        return len(expanded_prompt_ids(processor, rendered.text, [decode(images[i]) for i in image_ids(row)]))

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "longer than model_max_length" warnings: check_context says it
    try:
        return max((length(row), i) for i, row in enumerate(rows))
    finally:
        hf_logging.set_verbosity(verbosity)


def check_images(cfg: Config, with_images: bool) -> None:
    """Prompts with images need a student that reads images; a teacher without a vision tower needs a
    teacher context that gives it the pictures' information as text; several teachers must process
    pictures alike (one set of teacher image tensors serves them all); guided prefixes are not built
    for images yet."""
    if not with_images:
        return
    if not is_vision_model(cfg.student):
        raise GndpoError(f"the prompts have images but the student {cfg.student} has no vision tower (no vision_config in its config.json)")
    load_processor(cfg.student)
    if cfg.rollout.guided_fraction > 0:
        raise GndpoError("prompts with images do not work with rollout.guided_fraction yet")
    if cfg.teacher == SELF_TEACHER:
        return
    paths = list(cfg.teacher_models().values())
    for path in paths:
        if not is_vision_model(path) and not cfg.teacher_context.messages:
            raise GndpoError(f"the prompts have images but the teacher {path} has no vision tower: give it the pictures' information "
                             "as text in teacher_context.messages (a caption or data column), or use a vision-language teacher")
    readers = [load_processor(p) for p in paths if is_vision_model(p)]
    mixed = bool(readers) and len(readers) < len(paths)  # text and vision teachers side by side
    if mixed or any(not same_image_processing(readers[0], r) for r in readers[1:]):
        raise GndpoError(f"the teachers {', '.join(paths)} process images differently; several teachers of one run must share one image processor")


def check_prompt_count(cfg: Config, prompts: int, held_out: int = 0) -> None:
    """Each round samples ``rollout.prompts_per_round`` distinct prompts, so data.train needs at least as
    many (with fewer, every round would quietly use fewer than the config says); ``held_out``: how many
    were held out of data.train for lack of a data.heldout file."""
    if prompts < cfg.rollout.prompts_per_round:
        after = (f" after {held_out} held out (name a data.heldout file, or set rollout.eval_heldout=false or data.heldout_share=0, "
                 "to train on all)" if held_out else "")
        raise GndpoError(
            f"data.train has {prompts} prompts{after}, fewer than rollout.prompts_per_round {cfg.rollout.prompts_per_round}: "
            f"set rollout.prompts_per_round to at most {prompts}, or add prompts"
        )


def check_prompts_fit(model_path: str, rows: list[dict], data, budget: int, budget_name: str, max_len: int) -> None:
    """Every prompt of ``rows``, rendered as rollout renders it, plus ``budget`` response tokens fits an
    engine's ``max_len``; the error names the longest prompt (`gndpo eval`'s check: vLLM would refuse
    the request mid-run)."""
    longest, row = longest_prompt(model_path, rows, data, {})
    if longest + budget > max_len:
        raise GndpoError(f"prompt {rows[row].get('prompt_id') or rows[row]['prompt'][:40]!r} has {longest} tokens; plus {budget_name} {budget} "
                         f"that is more than the engine's max_model_len {max_len}")


def check_context(cfg: Config, splits: dict, images: dict[str, bytes]) -> int:
    """Every prompt plus ``rollout.max_tokens`` fits vLLM's ``max_model_len`` (rollout samples the train
    prompts and, with ``rollout.eval_heldout``, decodes the held-out ones with the same budget), and
    ``engine.max_model_len`` is not beyond the student's own context length (vLLM would refuse it).
    Returns the longest prompt's tokens."""

    own = model_context_length(cfg.student)
    max_len = resolve_max_model_len(cfg.student, cfg.engine)
    if max_len > own:
        raise GndpoError(
            f"engine.max_model_len {max_len} exceeds the student's context length {own} (max_position_embeddings); "
            f"set engine.max_model_len <= {own}, or 0 for the model's own"
        )
    names = [split for split in PROMPT_SPLITS if (split == "train" or cfg.rollout.eval_heldout) and splits[split].height]
    (longest, row), where = max((longest_prompt(cfg.student, splits[s].to_dicts(), cfg.data, images), s) for s in names)
    total = longest + cfg.rollout.response_tokens
    if total > max_len:
        budget = "rollout.max_tool_response_tokens" if cfg.rollout.tools else "rollout.max_tokens"
        source = "engine.max_model_len" if cfg.engine.max_model_len else "engine.max_model_len 0 = the student's own"
        knobs = [f"raise engine.max_model_len (at most {own}, the student's context length)"] if max_len < own else []
        knobs += [f"lower {budget}", "shorten the prompts"]
        raise GndpoError(
            f"the longest data.{where} prompt (row {row + 1}, prompt_id {splits[where]['prompt_id'][row]}) has {longest} tokens; "
            f"plus {budget} {cfg.rollout.response_tokens} "
            f"that is {total}, more than max_model_len {max_len} ({source}): {', or '.join(knobs)}"
        )
    return longest


def check_teacher_prompts(cfg: Config, train: list[dict], pictures: Callable[[str], object] | None = None) -> None:
    """Each teacher can read every training prompt as score will give it: through its chat template
    (a cross-tokenizer teacher renders prompts itself), with the teacher context, and with each picture
    expanded by the teacher's own processor (``pictures``: image id -> PIL image, for prompts with
    images); the longest such prompt plus the response budget fits the teacher's context length. Errors
    name the teacher."""
    with_images = pictures is not None and any(image_ids(row) for row in train)
    if not (cfg.teacher_context.messages or cfg.score.cross_tokenizer or with_images):
        return

    paths = {"teacher (self)": cfg.student} if cfg.teacher == SELF_TEACHER else {f"teacher {p}": p for p in cfg.teacher_models().values()}
    student_template = uses_template(load_tokenizer(cfg.student), cfg.data)
    for name, path in paths.items():
        teacher_tok = load_tokenizer(path)
        if cfg.score.cross_tokenizer and student_template and not uses_template(teacher_tok, cfg.data):
            logging.getLogger("gndpo").warning(
                "%s has no chat template: it reads each prompt as bare text while the student reads it through its "
                "chat template; add one to its tokenizer_config.json if it is a chat model", name)
        try:
            images = {"processor": load_processor(path), "pictures": pictures} if with_images and is_vision_model(path) else {}
            prompts = TeacherPrompts(teacher_tok, cfg.data, cfg.teacher_context, train, **images)
            longest = max(len(prompts.token_ids(row)) for row in train)
        except GndpoError as exc:
            raise GndpoError(f"{name}: {exc}") from None
        limit = resolve_max_model_len(path, cfg.score.engine) if backend_of(cfg).capabilities.engine else model_context_length(path)
        if longest + cfg.rollout.response_tokens > limit:
            raise GndpoError(
                f"{name}: its longest prompt ({longest} tokens with the teacher context) plus {cfg.rollout.response_tokens} "
                f"response tokens exceeds its context length {limit}: shorten teacher_context.messages or the responses"
            )


def check_routes(cfg: Config, train: list[dict]) -> None:
    """With several teachers routed by prompt, every training prompt (a prompt-table row) names one."""
    if not cfg.teachers or cfg.score.teacher_mix != "route":
        return
    key = cfg.data.teacher_key
    if train and "teacher" not in train[0]:
        raise GndpoError(f"score.teacher_mix route needs a {key!r} column in data.train naming each prompt's teacher")
    unknown = sorted({r["teacher"] for r in train if r["teacher"] not in cfg.teachers}, key=str)
    if unknown:
        raise GndpoError(f"data.train routes prompts to teachers not in teachers: {', '.join(map(str, unknown[:5]))} "
                         f"(teachers: {', '.join(cfg.teachers)})")


def check_tools(cfg: Config, row: dict) -> None:
    """Every tool the config names imports, and the student's chat template renders a tool turn (on
    ``row``), so tool use is refused at init rather than in the middle of a rollout; so does each
    teacher's with ``score.cross_tokenizer`` (it reads each tool's answer through its own template)."""
    if not cfg.rollout.tools:
        return

    ToolUse.from_config(cfg.rollout)
    tool_turn_ids(load_tokenizer(cfg.student), row, cfg.data, "gndpo-probe-result")
    if cfg.score.cross_tokenizer:
        for name, path in cfg.teacher_models().items():
            try:
                tool_turn_ids(load_tokenizer(path), row, cfg.data, "gndpo-probe-result")
            except GndpoError as exc:
                raise GndpoError(f"teacher {name}: {exc}") from None


def check_metrics_backends(cfg: Config) -> None:
    """Each of ``logging.backends`` must be importable here (a missing one would only warn later)."""

    for backend, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if backend in cfg.logging.backends and importlib.util.find_spec(module) is None:
            raise GndpoError(f"logging.backends names {backend}, which is not installed (pip install 'gndpo[metrics]')")


@dataclasses.dataclass(frozen=True)
class ResolvedModels:
    """A config's models resolved to local folders once, at ``gndpo init`` (or fork): ``local`` is the
    config with each model replaced by its folder, for the checks that read the models; ``teacher_runs``
    and ``hub_models`` are what run.yaml records so every later process reads the same files."""

    local: Config
    teacher_runs: dict  # {"run:...": resolution} (gndpo.pipeline.run.teacher_runs)
    hub_models: dict  # {"org/name[@rev]": {id, revision, commit}} (gndpo.storage.hub)

    def records(self) -> dict:
        """The run.yaml sections of the resolutions (none for a run of local folders)."""
        return {k: v for k, v in (("teacher_runs", self.teacher_runs), ("hub_models", self.hub_models)) if v}


def resolve_models(cfg: Config, known_runs: dict | None = None, known_hub: dict | None = None) -> ResolvedModels:
    """Resolve every model ``cfg`` names: a teacher that is another run's policy (``run:RUN[@K]``) to
    that policy's files, a hub id (``org/name[@rev]``) to a commit and its local snapshot, a folder to
    itself. ``known_runs`` / ``known_hub``: resolutions to keep as they are (a fork's, from its parent)."""
    runs, hub = dict(known_runs or {}), dict(known_hub or {})
    folders = {}
    for role, name in configured_models(cfg).items():
        if not name or name in folders:
            continue
        if is_reference(name):
            runs[name] = runs.get(name) or resolve_reference(name, open_run(parse_reference(name)[0]), model_cache_dir())
            folders[name] = teacher_folder(name, runs[name], model_cache_dir())
        elif name in hub:
            folders[name] = hub_snapshot(hub[name], role)
        elif is_hub_id(name):
            resolved = resolve_hub_model(name, role, weights=name not in served_teachers(cfg))
            hub[name], folders[name] = resolved.record(), resolved.folder
    used = set(folders)
    local = dataclasses.replace(cfg, student=folders.get(cfg.student, cfg.student), teacher=folders.get(cfg.teacher, cfg.teacher),
                                teachers={n: folders.get(t, t) for n, t in cfg.teachers.items()})
    return ResolvedModels(local, {k: v for k, v in runs.items() if k in used}, {k: v for k, v in hub.items() if k in used})


def run_yaml(cfg: Config, models: ResolvedModels, **extra) -> bytes:
    """A run's ``run.yaml``: the config as written, then what was resolved when the run was created."""
    more = {**models.records(), **extra}
    return (config_to_yaml(cfg) + (yaml.safe_dump(more, sort_keys=False) if more else "")).encode()


def init_run(url: str, cfg: Config, gpu_bytes: int | None = None, gpus: int | None = None) -> Run:
    """Create the run at ``url`` from ``cfg`` after every check (settings, models, prompts, context),
    writing the prompts and, last and exclusively, run.yaml; the existing run where ``url`` holds one
    made from the same config, a GndpoError where it holds another. ``gpu_bytes``: the GPU each stage's
    memory is estimated for (:mod:`gndpo.stages.models.gpu_memory`; default: this machine's, none without one);
    ``gpus``: the GPUs `gndpo run` will use (train's ranks with ``train.num_processes`` 0, and the
    devices the round order is chosen for; default: this machine's)."""
    fs = RunFS(url)
    if fs.exists("run.yaml"):
        existing = open_run(url)
        if existing.cfg.fingerprint() != cfg.fingerprint():
            raise GndpoError(f"run folder {url} was created from another config; use a new folder")
        return existing
    models = resolve_models(cfg)
    gpus = visible_gpus() if gpus is None else gpus
    with read_once():  # the checks read the same models' tokenizers and configs many times
        splits, images = checked_prompts(url, models.local)
        check_gpu_memory(models.local, gpu_bytes or gpu_memory(), backend_of(cfg).capabilities, rollout_backend(cfg).capabilities,
                         train_ranks(cfg, gpus))
        probes = backend_of(cfg).check_teachers(cfg, models.local, bool(images))
    say_held_out(cfg, splits)
    store_images(fs, images)
    for split, table in splits.items():
        write_prompt_table(fs, f"prompts/{split}.parquet", table)
    if not fs.create("run.yaml", run_yaml(cfg, models, **({"served_probes": probes} if probes else {}))):
        # A concurrent init won; accept it only if it is the same experiment.
        return init_run(url, cfg, gpu_bytes, gpus)
    # How `gndpo run` will order the stages on this machine (it says so again, for the GPUs it is given).
    logging.getLogger("gndpo").info(choose_order(cfg, gpus).line())
    return open_run(url)


def prompt_tables(cfg: Config) -> dict[str, pl.DataFrame]:
    """{"train": ..., "heldout": ...}: data.train's prompts and the held-out ones, from data.heldout or,
    without it, held out of data.train (:func:`split_heldout`; one line says how many); an empty
    held-out table where rollout.eval_heldout is off and no file is named."""
    if not cfg.data.train:
        raise GndpoError("config has no data.train prompts file")
    # What needs the training prompts' answers (a reward the method trains on, a teacher context
    # showing it); without answers the held-out figure is label-free (Run.heldout_measure).
    train = load_prompts(cfg.data.train, cfg.data, keep=cfg.teacher_context.columns(), answers_for=answer_readers(cfg))
    if cfg.data.heldout:
        return {"train": train, "heldout": load_prompts(cfg.data.heldout, cfg.data)}
    if not cfg.rollout.eval_heldout:
        return {"train": train, "heldout": train.head(0)}
    kept, heldout = split_heldout(train, cfg.data)
    return {"train": kept, "heldout": heldout}


def say_held_out(cfg: Config, splits: dict[str, pl.DataFrame]) -> None:
    """One line, once every check has passed, where init held prompts out of data.train."""
    held = splits["heldout"].height
    if held and not cfg.data.heldout:
        logging.getLogger("gndpo").info(
            f"data.heldout is not set: {held} of data.train's {held + splits['train'].height} prompts are held out (by a hash of each "
            "prompt, never trained on) for each round's held-out figure; name a file with data.heldout=FILE, or train on all with "
            "rollout.eval_heldout=false")


def checked_prompts(url: str, cfg: Config) -> tuple[dict, dict]:
    """Every check of a new run (``cfg`` names the models' local folders) and its prompts, read and
    checked: ({split: prompt table}, {image id: bytes}), nothing written yet."""
    validate_method(cfg.method)
    check_staleness(cfg)
    check_metrics_backends(cfg)
    check_teacher_backend(cfg)
    check_precision(cfg)
    check_models(cfg)
    images = {}  # id -> bytes, stored after every check has passed
    splits = {split: with_image_ids(table, images, f"data.{split}") for split, table in prompt_tables(cfg).items()}
    check_prompt_count(cfg, len(splits["train"]), 0 if cfg.data.heldout else len(splits["heldout"]))
    check_images(cfg, bool(images))
    check_rollout_backend(cfg, bool(images))
    check_round_fits(url, cfg, check_context(cfg, splits, images))
    train = splits["train"].to_dicts()
    check_rewards(cfg, train[0])
    check_tools(cfg, train[0])
    check_routes(cfg, train)
    check_teacher_prompts(cfg, train, lambda image: decode(images[image]))
    return splits, images
