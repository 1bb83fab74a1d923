"""What an in-process command loads it releases when it returns: a process that calls gndpo's functions
(a script, a notebook, a pytest worker) gets its engines and models back, not a resident set that grows
with every command (a pytest worker held 13 GiB after the real-model tests).

Four things kept them before: the traceback of an import error vLLM keeps in a module global, whose
frames held the callers of the process's first ``import vllm`` (the first engine among their locals);
vLLM's reload records, which keep a reloaded model alive after its engine is gone; the gradient hooks
ZeRO registers, held by autograd, which keep a dropped DeepSpeed engine alive; and the module-level
stack ZeRO-3 leaves its model on. The tests count the objects that hold the memory (engines and
models), not the resident set, which the allocator decides.
"""

import gc
import sys
from collections import Counter

import pytest
import torch

from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import EngineConfig
from tests.conftest import invoke_ok, run_stages

pytestmark = pytest.mark.slow


def engines_and_models() -> Counter:
    """{kind: how many are alive} of vLLM engines, DeepSpeed engines and vLLM's model modules, once
    the garbage collector has run."""
    gc.collect()
    alive = Counter()
    for obj in gc.get_objects():
        kind = type(obj)
        if kind.__name__ in ("LLM", "DeepSpeedEngine"):
            alive[kind.__name__] += 1
        elif isinstance(obj, torch.nn.Module) and kind.__module__.startswith("vllm.model_executor"):  # a type's own __module__ may be a descriptor
            alive["vLLM model module"] += 1
    return alive


def test_stage_commands_and_a_closed_kept_set_leave_no_engine_or_model_alive(rolled_out, tmp_path):
    """Round 0 re-scored and trained under ZeRO-3 by stage commands in this process (each with its
    own set of engines), then round 1's rollout on a kept engine that loads the trained weights into
    itself: once the commands have returned and the kept set is closed, no engine and no model is
    left alive that was not before."""
    from gndpo.stages.models.live import LiveModels

    before = engines_and_models()
    url = tmp_path / "zero3"
    invoke_ok("fork", rolled_out, url, "--from-round", "0", "train.zero_stage=3")
    run_stages(url, "score", "normalize", "train")
    run = open_run(str(url))
    live = LiveModels(keep=True, log=lambda *_: None)
    try:
        live.student_engine(run.policy_path(0), run.cfg.engine, seed=run.cfg.rollout.seed)
        run_stages(url, "rollout", round_idx=1, live=live)
        assert live.probe["engine_reloaded"] == 1, live.probe  # the kept engine took round 1's weights
    finally:
        live.close()
    assert engines_and_models() == before


def test_no_import_error_vllm_keeps_holds_the_frames_of_its_importers(tiny_assets, monkeypatch):
    """vLLM keeps the error of an optional import in a module global (torchcodec's, where it is not
    installed), and its traceback holds the frames of the process's first ``import vllm`` with every
    caller's locals; once make_llm has imported vLLM, no error vLLM keeps has its traceback."""
    import vllm
    import vllm.multimodal.media.audio  # noqa: F401  (a module that keeps its import error)

    from gndpo.stages.models import vllm_engine

    class FakeLLM:  # the engine itself is not the point
        def __init__(self, **_):
            pass

    monkeypatch.setattr(vllm, "LLM", FakeLLM, raising=False)
    vllm_engine.make_llm(str(tiny_assets / "student"), EngineConfig(max_model_len=32, in_process=False))
    kept = [f"{name}.{key}" for name, module in list(sys.modules.items()) if name.split(".")[0] == "vllm"
            for key, value in list(vars(module).items()) if isinstance(value, BaseException) and value.__traceback__ is not None]
    assert kept == []
