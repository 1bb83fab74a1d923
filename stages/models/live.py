"""The engines and models a stage runs on, and keeping them alive between stages and rounds.

Every stage asks a :class:`LiveModels` for what it computes with: rollout for the student's vLLM engine,
score for the student and teacher modules, train for the DeepSpeed engine. A one-stage process (``gndpo
score ...``, a ``--worker``) gets a ``LiveModels(keep=False)``, which simply builds each one. ``gndpo run``
on one machine runs the whole loop in one process with ``keep=True``, and then a round's start-up cost is
paid once per run instead of once per stage and round:

* the vLLM engine stays up; each round loads the new student's weights into it from the exported folder
  (``reload_weights``) instead of starting an engine (20 s on CPU, a minute or more with CUDA graphs);
* the teacher module stays loaded (it never changes); the student module is refilled from the exported
  weights;
* the DeepSpeed engine that finished round k trains round k+1 as it is, skipping the rebuild, the
  weight load and the optimizer-state download, but only when round k's committed student is the one
  this engine exported (see :meth:`LiveModels.train_engine`). Anything else, a lost commit race, an
  in-round checkpoint to resume or a failed update, falls back to the rebuild from storage.

Nothing about the storage protocol changes: every stage still writes, commits and reads through the
run folder, so a run killed anywhere resumes the same way, and ``--worker`` processes can still join.
On a GPU the engine is started with vLLM's sleep mode and put to sleep (weights offloaded, KV cache
freed) while score and train hold the device, and the kept teacher waits in CPU memory during train.
The DeepSpeed engine is not kept past the next vLLM engine's start or wake-up on a GPU: vLLM sizes its KV
cache from the device's free memory, and the trainer (about 14 bytes a parameter) with the allocator's
cached blocks left too little for it (bench/results/gpu_check.md); the next round's train rebuilds it
from storage. This GPU path has not run with vLLM on a GPU yet.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gndpo.pipeline.settings.schema import Config, EngineConfig
from gndpo.stages.models.device import resolve_dtype
from gndpo.stages.models.loading import load_causal_lm, model_config
from gndpo.stages.models.lora import ADAPTER_DIR, adapted_student, policy_state_dict
from gndpo.stages.models.probe import CALIBRATED, TOLERANCE, probe_gap
from gndpo.stages.models.teacher_server import ServerPool, ServerSettings, checked
from gndpo.stages.models.vllm_engine import (
    AdapterEngine,
    adapter_request,
    cuda_available,
    engine_alive,
    engine_dtype,
    engine_processes,
    in_process_engine,
    make_llm,
    shutdown_llm,
)


@dataclass
class _Engine:
    llm: object
    key: tuple  # what the engine was built with, apart from the weights
    weights: str  # the folder whose weights it holds now
    asleep: bool = False
    processes: frozenset = field(init=False)  # its engine-core and worker pids once started (engine_alive)

    def __post_init__(self):
        self.processes = engine_processes(self.llm)

    @property
    def in_process(self) -> bool:
        """engine.in_process: vLLM runs inside this process."""
        return in_process_engine(self.llm)


@dataclass
class _Trainer:
    engine: object
    key: tuple
    exported_to: str | None = None  # the model folder (run-relative) of the update this engine finished
    partitioned: bool = False  # ZeRO-3: the module holds this rank's partitions, not the weights
    pending: object | None = None  # its optimizer state still being written (wait()), train.state_async

    def settled(self) -> "_Trainer":
        """This trainer once its pending state write has finished: before its engine changes or goes."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        return self


@dataclass
class LiveModels:
    """Builds (``keep=False``) or builds once and then reuses (``keep=True``) the stages' engines and
    models. Only one process and one rank use a kept object; multi-rank train never keeps one."""

    keep: bool = False
    log: object = print
    _engine: _Engine | None = None
    _modules: dict = field(default_factory=dict)  # (path, dtype, device) -> module, teacher only
    _trainer: _Trainer | None = None
    _teacher_engine: _Engine | None = None  # score.backend vllm
    probe: dict | None = None  # the latest student engine's gap to its exported model (stages.probe)
    _adapter_ids: dict = field(default_factory=dict)  # adapter folder -> its vLLM LoRA id (adapter_engine)
    _calibrated: dict = field(default_factory=dict)  # engine key -> probe tolerance a fresh engine's gap set
    _pools: dict = field(default_factory=dict)  # ServerSettings -> ServerPool (score.backend server)
    _unkept: list = field(default_factory=list)  # weak references to the vLLM engines built here without keeping them, for close()
    _trainers: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # the DeepSpeed engines built here, not yet released

    # -- rollout, eval: the student's vLLM engine ----------------------------------------------------
    def student_engine(self, policy: str, cfg: EngineConfig, seed: int, images: int = 0, exported: str | None = None):
        """A vLLM engine holding ``policy``'s weights. Kept: the running engine when it was built with
        the same settings, after loading ``policy``'s weights into it if it holds another folder's:
        from the kept DeepSpeed engine's memory when that engine exported ``policy`` (``exported``: the
        URL of the committed folder ``policy`` was taken from) and vLLM runs in this process, else
        from ``policy``'s files.
        ``seed`` is the engine's default seed, used by requests without their own; gndpo's requests all
        carry one (or are greedy), so a kept engine is reused whatever seed it was started with.
        ``images``: the most pictures one prompt shows (0 for text).

        Where train recorded a probe beside ``policy`` (:mod:`gndpo.stages.models.probe`), the engine's gap to
        it is measured (``self.probe``) and a reloaded engine beyond the tolerance is replaced by a
        fresh one, with a warning."""
        if not self.keep:
            llm = self._unkept_engine(make_llm(policy, cfg, seed=seed, images=images))
            self.probe = self._measure_probe(llm, policy, reloaded=False)
            return llm
        self.free_device_for_engine()
        key = (repr(cfg), _architecture(policy), images)
        live = self._kept_engine(key)
        restarted = 0
        if live is not None and live.weights != policy and not self._reloaded_within_tolerance(live, policy, cfg, exported, images):
            self.close_engine()
            live, restarted = None, 1
        if live is None:
            self._engine = _Engine(make_llm(policy, cfg, seed=seed, sleep_mode=cuda_available(), images=images), key, policy)
            self.probe = self._measure_probe(self._engine.llm, policy, reloaded=False, restarted=restarted)
            if restarted:
                self._calibrate_tolerance(key, cfg)
        return self._engine.llm

    def _tolerance(self, key: tuple, cfg: EngineConfig) -> float:
        """The largest probe gap a reload into the engine built with ``key`` may show: the engine dtype's,
        or what a fresh engine's own gap calibrated it to (:meth:`_calibrate_tolerance`)."""
        return max(TOLERANCE[engine_dtype(cfg)], self._calibrated.get(key, 0.0))

    def _calibrate_tolerance(self, key: tuple, cfg: EngineConfig) -> None:
        """After a restart. A fresh engine holds exactly the exported weights, so its own gap is what the
        engine's precision costs on this model (bf16 against the trainer's forward: a mean of 0.017 at
        1B, against a dtype tolerance of 0.03); where that is beyond the dtype's tolerance, later reloads
        are held to ``CALIBRATED`` times it instead, or every round would restart the engine."""
        fresh = self.probe["engine_probe_gap_mean"] if self.probe is not None else 0.0
        if fresh > TOLERANCE[engine_dtype(cfg)]:
            self._calibrated[key] = CALIBRATED * fresh
            logging.getLogger("gndpo").warning(
                f"engine: a fresh engine is {fresh:.2g} from the exported model on the probe batch too (above the "
                f"{engine_dtype(cfg)} tolerance {TOLERANCE[engine_dtype(cfg)]:g}): the engine's precision, not a stale reload; "
                f"later reloads are held to {CALIBRATED * fresh:.2g}")

    def _reloaded_within_tolerance(self, live: _Engine, policy: str, cfg: EngineConfig, exported: str | None, images: int) -> bool:
        """Load ``policy``'s weights into the kept engine and measure it on the probe; whether its gap
        is within the engine dtype's tolerance (False, with a warning: the caller starts a fresh one)."""
        memory = self._load_policy(live, policy, exported, images)
        self.probe = self._measure_probe(live.llm, policy, reloaded=True)
        tolerance = self._tolerance(live.key, cfg)
        if self.probe is not None and self.probe["engine_probe_gap_mean"] > tolerance:
            logging.getLogger("gndpo").warning(
                f"engine: after loading {policy} the kept engine's log-probs are {self.probe['engine_probe_gap_mean']:.2g} "
                f"from the exported model's on the probe batch (tolerance {tolerance:g}); starting a fresh engine"
            )
            return False
        self.log(f"engine: loaded the weights of {policy}" + (" from the trainer's memory" if memory else ""))
        return True

    def _kept_engine(self, key: tuple) -> _Engine | None:
        """The kept rollout engine, awake, if it is alive and was built with ``key``; else None (an engine
        built otherwise is closed first)."""
        live = self._engine = self._alive(self._engine, "the rollout engine")
        if live is not None and live.key != key:
            self.close_engine()
            return None
        if live is not None and live.asleep:
            live.llm.wake_up()
            live.asleep = False
        return live

    def adapter_engine(self, policy: str, cfg: EngineConfig, seed: int, base: str, rank: int) -> AdapterEngine:
        """The student of a ``model.lora`` run as vLLM serves LoRA: an engine on ``base`` (the initial
        student) whose requests carry ``policy``'s adapters (its ``adapter/``; none in round 0, where the
        fresh adapters add nothing). Kept, the engine holds the base weights for the whole run and
        takes each round's adapters per request: nothing is reloaded. The probe checks the engine with
        the adapters against train's own log-probs for the exported (merged) weights."""
        key = (repr(cfg), _architecture(base), "lora", rank)
        if self.keep:
            self.free_device_for_engine()
        live = self._kept_engine(key) if self.keep else None
        if live is None:
            llm = make_llm(base, cfg, seed=seed, sleep_mode=self.keep and cuda_available(), lora_rank=rank)
            if self.keep:
                self._engine = _Engine(llm, key, base)
            else:
                self._unkept_engine(llm)
        else:
            llm = live.llm
        folder = Path(policy) / ADAPTER_DIR
        ids = self._adapter_ids  # vLLM caches an adapter by its id: one id per folder
        request = adapter_request(str(folder), ids.setdefault(str(folder), len(ids) + 1)) if folder.is_dir() else None
        engine = AdapterEngine(llm, request)
        self.probe = self._measure_probe(engine, policy, reloaded=False)
        if self.probe is not None:
            self.probe["engine_adapters"] = int(request is not None)  # rollout's metric: the round's adapters served
        return engine

    def _load_policy(self, live: _Engine, policy: str, exported: str | None, images: int) -> bool:
        """Load ``policy``'s weights into the kept engine ``live``: handed over from the kept trainer's
        memory where that works (a text model's engine in this process; a VLM's checkpoint names are
        its files'), else read from ``policy``'s files. Returns whether the memory served."""
        weights = self._trained_weights(exported) if live.in_process and not images else None
        live.llm.collective_rpc("reload_policy", kwargs={"weights_path": policy} if weights is None else {"weights": weights})
        # Cached KV blocks and image features were computed by the previous weights (a VLM's engine
        # fails with "Encoder cache miss" if only the prefix cache is reset).
        live.llm.reset_prefix_cache()
        if images:
            live.llm.llm_engine.reset_encoder_cache()
        live.weights = policy
        return weights is not None

    @staticmethod
    def _alive(live: _Engine | None, name: str) -> _Engine | None:
        """``live``, or None (with a warning, after releasing what is left of it) if its engine process
        has died since it was last used, so that a fresh engine replaces it."""
        if live is None or engine_alive(live.llm, live.processes):
            return live
        logging.getLogger("gndpo").warning(
            f"engine: {name} kept from an earlier stage has stopped (its process exited: a signal sent to this process "
            "group, or the machine's memory); starting a fresh one")
        try:
            shutdown_llm(live.llm)
        except Exception:  # what is left of a dead engine may fail to close; it holds nothing now
            pass
        return None

    @staticmethod
    def _measure_probe(llm, policy: str, reloaded: bool, restarted: int = 0) -> dict | None:
        """Rollout's engine metrics: the probe gap, whether the weights were reloaded into a running
        engine, and whether a reload failed the check and a fresh engine replaced it."""
        gap = probe_gap(llm, policy)
        if gap is None:
            return None
        return {"engine_probe_gap_max": gap["max"], "engine_probe_gap_mean": gap["mean"],
                "engine_reloaded": int(reloaded), "engine_restarted": restarted}

    def free_device_for_engine(self) -> None:
        """On a GPU, before a vLLM engine starts or wakes up: drop the kept DeepSpeed engine and return the
        allocator's cached blocks to the device. vLLM takes ``engine.gpu_memory_utilization`` of the
        device's memory and refuses to start (or wake) where less is free; the trainer and the cache
        left too little (at 1B on an H200: 111.96 GiB free, 118.83 asked). The next round's train
        rebuilds the engine from the committed export and optimizer state."""
        if not cuda_available():
            return
        import torch

        self.drop_trainer()
        gc.collect()  # a DeepSpeed engine holds reference cycles: dropping the name frees nothing until now
        torch.cuda.empty_cache()

    def release_engine(self) -> None:
        """Let the other stages have the device: on a GPU the kept engines (the student's, and the
        teacher's of ``score.backend: vllm``) sleep (weights to CPU memory, KV cache freed); on CPU there
        is nothing to release. A one-stage process shuts its engines down when it exits."""
        self._engine = self._alive(self._engine, "the rollout engine")
        self._teacher_engine = self._alive(self._teacher_engine, "the teacher's engine")
        for live in (self._engine, self._teacher_engine):
            if live is not None and not live.asleep and cuda_available():
                live.llm.sleep(level=1)
                live.asleep = True

    def _unkept_engine(self, llm):
        """``llm``, built for one stage (``keep=False``): shut down by :meth:`close`, when the command that
        made this set ends (:func:`gndpo.apps.rounds.run_stage`), if its user has not dropped it before
        (a weak reference: this set does not make it live longer)."""
        self._unkept.append(weakref.ref(llm))
        return llm

    def close_engine(self) -> None:
        if self._engine is not None:
            self._shut_down(self._engine)

    def _shut_down(self, live: _Engine) -> None:
        """Stop ``live``'s engine and forget it. An in-process engine's shutdown destroys every
        torch.distributed group of this process (vLLM's ``cleanup_dist_env_and_memory``): the other
        in-process engine and the kept DeepSpeed engine lose theirs, so they go too and are rebuilt when
        next asked for (the trainer from the committed export, as in a fresh process)."""
        doomed = [live]
        if live.in_process:
            doomed += [e for e in (self._engine, self._teacher_engine) if e is not None and e is not live and e.in_process]
            self.drop_trainer()
        for engine in doomed:
            shutdown_llm(engine.llm)
            if engine is self._engine:
                self._engine = None
            if engine is self._teacher_engine:
                self._teacher_engine = None

    # -- score with score.backend vllm: the teacher's engine -------------------------------------------
    def teacher_engine(self, path: str, cfg: EngineConfig, max_logprobs: int = 0, images: int = 0):
        """A vLLM engine holding the teacher (``images``: the most pictures a prompt shows). Kept, it is
        started once per run (the teacher never changes) and sleeps on a GPU while other stages run; the
        student's engine sleeps while it scores."""
        if not self.keep:
            return self._unkept_engine(make_llm(path, cfg, max_logprobs=max_logprobs, images=images))
        self.free_device_for_engine()
        key = (path, repr(cfg), max_logprobs, images)
        live = self._teacher_engine = self._alive(self._teacher_engine, "the teacher's engine")
        if live is not None and live.key != key:
            self._shut_down(live)
            live = None
        if live is None:
            self._teacher_engine = live = _Engine(make_llm(path, cfg, sleep_mode=cuda_available(), max_logprobs=max_logprobs, images=images), key, path)
        if live.asleep:
            live.llm.wake_up()
            live.asleep = False
        return live.llm

    def teacher_pool(self, settings: ServerSettings, check: Callable[[ServerPool], None]) -> ServerPool:
        """A pool of the teacher's servers (``score.backend: server``), passed through ``check`` whenever
        a worker asks (it holds them to the teacher the run expects:
        :func:`gndpo.stages.teachers.served.hold_to_teacher`); kept, its connections last the run."""
        pool = self._pools.get(settings) if self.keep else None
        if pool is not None:
            check(pool)
            return pool
        pool = checked(ServerPool(settings), check)
        if self.keep:
            self._pools[settings] = pool
        return pool

    # -- score: HF modules -----------------------------------------------------------------------------
    def causal_lm(self, path: str, model_cfg, device, fixed: bool, base: str | None = None):
        """An eval-mode causal LM with ``path``'s weights on ``device``. ``fixed`` marks a model that never
        changes during a run (the teacher); kept, it is loaded once. The student is loaded each round
        (cheap next to its forward passes, and always the exported weights); with ``base`` (model.lora:
        the initial student) it is ``base`` plus the adapters ``path`` carries, computed unmerged as
        train computes it."""
        if base is not None:
            return adapted_student(path, base, model_cfg, device, resolve_dtype(model_cfg.dtype, device)).to(device).eval()
        if not (self.keep and fixed):
            return load_causal_lm(path, model_cfg, device).eval()
        key = (path, repr(model_cfg), str(device))
        if key not in self._modules:
            self._modules[key] = load_causal_lm(path, model_cfg, device).eval()
        module = self._modules[key]
        if module.device != device:  # parked in CPU memory by release_modules()
            module.to(device)
        return module

    def release_modules(self) -> None:
        """On a GPU, park the kept modules (the teacher) in CPU memory while train holds the device."""
        if not cuda_available():
            return
        import torch

        for module in self._modules.values():
            module.to("cpu")
        torch.cuda.empty_cache()

    # -- train: the DeepSpeed engine -----------------------------------------------------------------
    def train_engine(self, cfg: Config, policy: str, policy_dir: str | None, world: int, base: str | None = None, *, build: Callable):
        """(DeepSpeed engine on ``policy``, whether it continues from the previous round as it is);
        ``build(cfg, policy, world, base)`` makes a new one (train's
        :func:`~gndpo.stages.training.deepspeed_engine.build_engine`: training sits above the models here).

        ``policy_dir`` is the URL of the committed model folder ``policy`` was downloaded from (None in
        round 0). The kept engine is reused only if it is the one that exported exactly that folder, i.e.
        its weights and optimizer state are the committed end of the previous round of the same run."""
        key = (repr(cfg.train), repr(cfg.model), world)
        live = self._trainer and self._trainer.settled()
        self._trainer = None  # an update that fails half-way must not leave a half-updated engine here
        if self.keep and world == 1 and live is not None and live.key == key and policy_dir is not None and live.exported_to == policy_dir:
            return live.engine, True
        # Another round's or another run's engine: freed before a new one is built beside it. A DeepSpeed
        # engine holds reference cycles (hooks, optimizer and parameters), so dropping the name frees
        # nothing until the cycle collector runs.
        del live
        self._release_trainers()
        gc.collect()
        if cuda_available():
            import torch

            torch.cuda.empty_cache()
        engine, _ = build(cfg, policy, world, base)
        self._trainers.add(engine)
        return engine, False

    def _release_trainers(self) -> None:
        """End the life of every DeepSpeed engine built here (one process trains with one engine at a
        time, so a new one, or the end of this set, ends the others'): ``DeepSpeedEngine.destroy``
        removes what the engine registered outside itself. Under ZeRO 1 and 2 that is a gradient hook
        on every parameter, held by autograd, whose closure holds the optimizer: a cycle through C++
        that the garbage collector cannot see, so a dropped engine kept its model, gradients and
        optimizer state for the life of the process (2 GiB per SmolLM2 135M train)."""
        for engine in list(self._trainers):
            self._trainers.discard(engine)
            destroy = getattr(engine, "destroy", None)
            if destroy is not None:
                destroy()
            _forget_zero3_module(engine)

    def _trained_weights(self, exported: str | None) -> dict | None:
        """{checkpoint name: tensor} of the kept DeepSpeed engine if it exported exactly ``exported``
        (the weights it holds are then that folder's), else None. Not under ZeRO-3, whose module
        holds partitions only."""
        live = self._trainer
        if live is None or exported is None or live.exported_to != exported or live.partitioned:
            return None
        return {name: tensor.detach() for name, tensor in policy_state_dict(live.engine.module).items()}

    def keeps_trainer(self, world: int) -> bool:
        """Whether :meth:`trained` keeps a ``world``-rank engine for the next round."""
        return self.keep and world == 1

    def trained(self, engine, cfg: Config, world: int, model_dir: str, pending=None) -> None:
        """Record that ``engine`` finished an update and exported it to ``model_dir`` (a URL); kept for
        the next round if this process keeps models (one rank only). ``pending``: its optimizer state's
        write in progress (an object with ``wait()``; only for a kept engine, :meth:`keeps_trainer`),
        waited for before the engine changes or goes."""
        if self.keeps_trainer(world):
            self._trainer = _Trainer(engine, (repr(cfg.train), repr(cfg.model), world), model_dir, cfg.train.zero_stage == 3, pending)

    def train_committed(self) -> None:
        """The train stage of the kept engine has committed: its deferred state's record may follow."""
        if self._trainer is not None and self._trainer.pending is not None:
            self._trainer.pending.release()

    def drop_trainer(self) -> None:
        """Forget the kept DeepSpeed engine, once its pending state write (if any) has finished, and
        release it (:meth:`_release_trainers`)."""
        if self._trainer is not None:
            self._trainer.settled()
        self._trainer = None
        self._release_trainers()

    def let_go_of_samplers(self) -> None:
        """The run's last rollout is done: shut the student's engine down (:meth:`_let_go`)."""
        self._let_go(self._engine)

    def let_go_of_teachers(self) -> None:
        """The run's last score is done: the teacher's modules go, and its engine (:meth:`_let_go`)."""
        self._modules.clear()
        self._let_go(self._teacher_engine)

    def _let_go(self, live: _Engine | None) -> None:
        """Shut ``live`` down unless that would cost the kept trainer (an in-process engine's shutdown
        drops it, :meth:`_shut_down`, and the next train would then reload or replay the optimizer
        state it holds)."""
        if live is not None and not (live.in_process and self._trainer is not None):
            self._shut_down(live)

    def close(self) -> None:
        self.drop_trainer()  # first: an in-process engine's shutdown destroys the groups the write may use
        while (live := self._engine or self._teacher_engine) is not None:
            self._shut_down(live)
        while self._unkept:
            shutdown_llm(self._unkept.pop())
        self._modules.clear()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _forget_zero3_module(engine) -> None:
    """Take ``engine``'s model off the module-level stack DeepSpeed's ZeRO-3 pushes it on when it builds
    the engine and never pops (``deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK``, 0.19.7;
    ``destroy`` leaves it there): through the engine's hooks on it, the model would keep the whole
    engine for the life of the process."""
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")  # loaded only where ZeRO-3 ran
    stack, module = getattr(offload, "FWD_MODULE_STACK", None), getattr(engine, "module", None)
    if stack is not None and module is not None:
        stack[:] = [m for m in stack if m is not module]


# Config entries that fix the shapes of a model's weights: equal ones load into a running engine.
SHAPE_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings")


def _architecture(path: str) -> str:
    """What must match for ``path``'s weights to load into an engine built on another folder."""
    if not (Path(path) / "config.json").is_file():
        return os.path.abspath(path)
    data = model_config(path)
    return json.dumps({k: data.get(k) for k in SHAPE_KEYS}, sort_keys=True)
