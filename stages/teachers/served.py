"""``score.backend: server``: the teachers are served apart by OpenAI-compatible servers (vLLM's, often
shared by several jobs), one pool a teacher (:mod:`gndpo.stages.models.teacher_server`, the client),
routed or mixed like the others.

Each pool is held to the teacher the run expects, at ``gndpo init`` and whenever a worker takes it
(:func:`check_servers`): the model each server reports, its tokenization of a probe text, and its
log-probs on a fixed probe sequence, within ``score.server_tolerance`` of the answers init recorded in
run.yaml (``served_probes``) and of each other; where the teacher's weights are local and small enough,
init also compares them with a forward of its own (:func:`check_against_weights`).
"""

from __future__ import annotations

import logging
from functools import partial

import numpy as np

from gndpo.errors import GndpoError
from gndpo.pipeline.settings.schema import SELF_TEACHER, Config
from gndpo.stages.models.device import free_memory, local_device, resolve_dtype
from gndpo.stages.models.loading import has_weights, is_vision_model, load_causal_lm, load_tokenizer, parameter_count, vocabulary_size
from gndpo.stages.models.probe import probe_logprobs, probe_token_ids
from gndpo.stages.models.prompt_logprobs import flat_response_logprobs
from gndpo.stages.models.teacher_server import Server, ServerPool, ServerSettings, checked
from gndpo.stages.teachers.base import Capabilities
from gndpo.stages.teachers.engine import Scorer, ScorerBackend
from gndpo.storage.hub import is_hub_id, split_hub_id

# A text with digits, spaces, punctuation, an accent and a newline: tokenizers that differ anywhere
# common usually differ here.
PROBE_TEXT = "Teacher check: 12 + 30 = 42, 6 x 7 = 42; naïve café.\nThe end!"
log = logging.getLogger("gndpo")


class ServerBackend(ScorerBackend):
    """Each teacher scored by its servers' pool, checked when this worker takes it."""

    capabilities = Capabilities(full_distribution=False, mixes_topk=False, weights_beside_student=False, engine=False, served=True)

    def __init__(self, setup):
        super().__init__(setup)
        self.pools: list[ServerPool] = []  # the teachers' pools, once made: their counts and states

    def scorer(self, name: str, path: str) -> Scorer:
        setup, score_cfg = self.setup, self.setup.cfg.score
        recorded = (setup.run.served_probes or {}).get(name)
        hold = partial(hold_to_teacher, teacher_folder=path, tolerance=score_cfg.server_tolerance, recorded=recorded)
        pool = setup.live.teacher_pool(teacher_server_settings(setup.cfg)[name], hold)
        if all(pool is not known for known in self.pools):  # teachers served by one pool count once
            self.pools.append(pool)
        return pool.response_logprobs

    def counts(self) -> dict[str, int]:
        """The servers' retried requests and cooldowns so far in this worker."""
        return {"server_retries": sum(p.retries for p in self.pools), "server_cooldowns": sum(p.cooldowns for p in self.pools)}

    def live_state(self) -> dict:
        """Each teacher server's state."""
        return {"servers": {url: state for pool in self.pools for url, state in pool.states().items()}}

    @classmethod
    def check_teachers(cls, cfg: Config, local: Config, with_images: bool, recorded: dict | None = None) -> dict[str, list[float]]:
        """Each teacher's servers serve the teacher the run expects, as :func:`checked_pool` checks it
        against the teacher's files and, where the folder holds the weights, against a forward of them
        (one line says how far); no teacher is shown pictures through them. Returns {teacher name: the
        servers' answers to the probe}: the record every score worker holds the servers to."""
        record = {}
        for (name, settings), folder in zip(teacher_server_settings(cfg).items(), served_models(local).values()):
            if with_images and is_vision_model(folder):
                raise GndpoError(f"score.backend server cannot show the vision-language teacher {name} the prompts' pictures (/v1/completions "
                                 "takes token ids without images): use score.backend hf or vllm, or a text teacher with teacher_context.messages")
            kept = (recorded or {}).get(name)
            pool = checked_pool(settings, folder, cfg.score.server_tolerance, kept)
            try:
                gap = check_against_weights(pool, folder, local.model, cfg.score.server_tolerance)
            finally:
                pool.close()
            if gap is not None:
                log.info(f"teacher {name}: its servers score the probe sequence {gap:.2g} from its weights in {folder} "
                         f"(score.server_tolerance {cfg.score.server_tolerance:g})")
            record[name] = kept or pool.probe
        return record


def check_servers(pool: ServerPool, tokenizer, vocabulary: int, tolerance: float, recorded: list[float] | None = None) -> list[float]:
    """Each server serves ``pool.settings.model``, tokenizes :data:`PROBE_TEXT` as ``tokenizer`` (the
    teacher's) does, and scores the probe sequences (:func:`~gndpo.stages.models.probe.probe_token_ids`
    below ``vocabulary``) within ``tolerance`` (mean |difference| of the log-probs) of ``recorded``, the
    served teacher's answers when the run was created, or, without a record, of the first server: a
    one-line GndpoError naming the server and the gap otherwise. Returns the pool's answers (the first
    server's), the record a new run keeps."""
    model, expected = pool.settings.model, tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    probe = probe_token_ids(vocabulary)
    reference = None if recorded is None else np.asarray(recorded, np.float32)
    answers = None
    for server in pool.servers:
        served = [m.get("id") for m in pool.request("/v1/models", None, server=server).get("data", [])]
        if model not in served:
            raise GndpoError(f"teacher server {server.url} serves {', '.join(map(str, served)) or 'no model'}, not {model} "
                             "(score.server_model names the teacher as its servers call it)")
        tokens = pool.request("/tokenize", {"model": model, "prompt": PROBE_TEXT, "add_special_tokens": False}, server=server).get("tokens")
        if tokens != expected:
            raise GndpoError(f"teacher server {server.url} tokenizes a probe text differently from the teacher's tokenizer "
                             f"({len(tokens or [])} tokens against {len(expected)}): it serves another tokenizer")
        scores = server_probe(pool, server, probe)
        answers = scores if answers is None else answers
        if reference is None:
            reference = scores
            continue
        gap = probe_gap(scores, reference)
        if not gap <= tolerance:
            against = (f"the teacher its servers served when the run was created (score.server_tolerance {tolerance:g}): it now serves "
                       "other weights or another precision") if recorded is not None else (
                       f"{pool.servers[0].url} (score.server_tolerance {tolerance:g}): the replicas serve different weights or precisions")
            raise GndpoError(f"teacher server {server.url} scores the probe sequence {gap:.3g} apart from {against}")
    return [float(x) for x in answers]


def server_probe(pool: ServerPool, server: Server, probe: list[list[int]]) -> np.ndarray:
    """``server``'s log-prob of each probe token after the first, sequence after sequence."""
    answers = [pool.prompt_logprobs(ids, 0, server=server) for ids in probe]
    return flat_response_logprobs(answers, [ids[1:] for ids in probe], 0)["logprobs"]


def probe_gap(scores, reference) -> float:
    """Mean |difference| of two probes' log-probs; inf where their lengths differ (another vocabulary's probe)."""
    scores, reference = np.asarray(scores, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(scores - reference).mean()) if scores.shape == reference.shape else float("inf")


# -- the run's teachers and their servers -------------------------------------------------------------
def served_models(cfg: Config) -> dict[str, str]:
    """{teacher name recorded per row: the model as the config names it} of the run's teachers: a
    self-teacher's servers serve the initial student (init refuses one that follows the student)."""
    return {f"self/{cfg.self_teacher.weights}": cfg.student} if cfg.teacher == SELF_TEACHER else cfg.teacher_models()


def teacher_server_settings(cfg: Config) -> dict[str, ServerSettings]:
    """{teacher name: its servers' settings} for ``cfg`` (``score.servers``, a list for one teacher or a
    mapping by teacher name): the name each serves its teacher under is ``score.server_model``'s, else
    the teacher's hub id (a one-line error for a local folder without one)."""
    score_cfg, settings = cfg.score, {}
    for name, model in served_models(cfg).items():
        urls = score_cfg.servers.get(name, []) if isinstance(score_cfg.servers, dict) else score_cfg.servers
        served = score_cfg.server_model.get(name, "") if isinstance(score_cfg.server_model, dict) else score_cfg.server_model
        if not urls:
            raise GndpoError(f"score.backend server: score.servers gives no URL for the teacher {name}")
        if not served and not is_hub_id(model):
            raise GndpoError(f"score.backend server: name the model the servers of the teacher {name} serve in score.server_model "
                             "(a local folder has no name a server reports)")
        settings[name] = ServerSettings.of(score_cfg, urls, served or split_hub_id(model)[0])
    return settings


def hold_to_teacher(pool: ServerPool, teacher_folder: str, tolerance: float, recorded: list[float] | None = None) -> None:
    """:func:`check_servers` with the tokenizer and vocabulary of the teacher at ``teacher_folder``; the
    pool's answers become its ``probe``."""
    pool.probe = check_servers(pool, load_tokenizer(teacher_folder), vocabulary_size(teacher_folder), tolerance, recorded)


def check_against_weights(pool: ServerPool, teacher_folder: str, model_cfg, tolerance: float) -> float | None:
    """The pool's probe answers (:func:`check_servers` first) against the teacher's own forward on its
    weights in ``teacher_folder`` (transformers, in ``model.dtype``): a one-line GndpoError beyond
    ``tolerance``; the gap, or None where the folder has no weights (a hub id served, not downloaded)."""
    if not has_weights(teacher_folder):
        return None
    device, weights = local_device(), parameter_count(teacher_folder)
    free = free_memory(device)
    if weights is None or free is None or weights * resolve_dtype(model_cfg.dtype, device).itemsize > free / 2:
        # A served teacher is often the one too large for this machine: no forward, one line says so.
        log.info(f"the teacher in {teacher_folder} is not compared with its servers here: its weights need more than half of "
                 f"this {device.type}'s free memory")
        return None
    model = load_causal_lm(teacher_folder, model_cfg, device).eval()
    local = probe_logprobs(model, vocabulary_size(teacher_folder), load_tokenizer(teacher_folder).pad_token_id or 0)
    del model
    if local["token_ids"] != probe_token_ids(vocabulary_size(teacher_folder)):
        return None  # a vision-language teacher's probe avoids its image tokens: not the servers' probe
    gap = probe_gap(pool.probe, [x for row in local["logprobs"] for x in row])
    if not gap <= tolerance:
        raise GndpoError(f"the teacher's servers score the probe sequence {gap:.3g} apart from its weights in {teacher_folder} "
                         f"(score.server_tolerance {tolerance:g}): they serve other weights or another precision")
    return gap


def checked_pool(settings: ServerSettings, teacher_folder: str, tolerance: float, recorded: list[float] | None = None) -> ServerPool:
    """A pool of ``settings``' servers, each held to the teacher at ``teacher_folder`` and to ``recorded``
    (:func:`check_servers`); the pool's probe answers are its ``probe``."""
    return checked(ServerPool(settings), partial(hold_to_teacher, teacher_folder=teacher_folder, tolerance=tolerance, recorded=recorded))
