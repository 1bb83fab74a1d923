"""vLLM engine settings (precision, CUDA graphs, context, chunked prefill, KV cache) and what `gndpo
init` refuses.

make_llm's arguments are checked against a stand-in ``vllm`` module, and the GPU branch is taken by
monkeypatching CUDA's availability; one slow test starts a real engine to see its KV cache. The init
checks run through the real CLI.
"""

import importlib.util
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from gndpo.errors import GndpoError
from gndpo.pipeline.settings.schema import EngineConfig
from gndpo.stages.models import vllm_engine as engine
from tests.conftest import assert_one_line_error, committed_rows, invoke, invoke_ok, run_stages, tiny_config_dict

ROOT = Path(__file__).resolve().parents[1]
TOY_CONTEXT = 64  # max_position_embeddings of the toy models


def fake_gpu(monkeypatch, bf16=True):
    monkeypatch.setattr(engine, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


def test_cpu_engine_is_fp32_eager_without_chunked_prefill(tiny_assets, monkeypatch):
    monkeypatch.setattr(engine, "cuda_available", lambda: False)
    student = str(tiny_assets / "student")
    kw = engine.engine_kwargs(student, EngineConfig(max_model_len=32, max_num_seqs=16), seed=7)
    assert kw["dtype"] == "float32" and kw["enforce_eager"] is True
    assert kw["enable_chunked_prefill"] is False and "gpu_memory_utilization" not in kw
    assert kw["max_model_len"] == 32 and kw["max_num_seqs"] == 16 and kw["seed"] == 7
    assert kw["tensor_parallel_size"] == 1 and kw["model"] == kw["tokenizer"] == student
    # cuda_graphs has no effect on the CPU build
    assert engine.engine_kwargs(student, EngineConfig(cuda_graphs=True))["enforce_eager"] is True


def test_max_model_len_zero_is_the_models_own(tiny_assets, tmp_path):
    student = str(tiny_assets / "student")
    assert engine.model_context_length(student) == TOY_CONTEXT
    assert engine.resolve_max_model_len(student, EngineConfig(max_model_len=0)) == TOY_CONTEXT
    assert engine.engine_kwargs(student, EngineConfig(), cuda=False)["max_model_len"] == TOY_CONTEXT
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2/config.json").write_text(json.dumps({"n_positions": 1024}))
    assert engine.model_context_length(str(tmp_path / "gpt2")) == 1024
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm/config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    assert engine.model_context_length(str(tmp_path / "vlm")) == 4096
    (tmp_path / "none").mkdir()
    (tmp_path / "none/config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(GndpoError, match="engine.max_model_len"):
        engine.model_context_length(str(tmp_path / "none"))


def test_gpu_engine_is_bf16_with_cuda_graphs(tiny_assets, monkeypatch):
    fake_gpu(monkeypatch)
    student = str(tiny_assets / "student")
    cfg = EngineConfig(gpu_memory_utilization=0.5, tensor_parallel_size=2, max_num_seqs=64)
    kw = engine.engine_kwargs(student, cfg)
    assert kw["dtype"] == "bfloat16" and kw["enforce_eager"] is False
    assert kw["gpu_memory_utilization"] == 0.5 and "enable_chunked_prefill" not in kw
    assert kw["tensor_parallel_size"] == 2 and kw["max_num_seqs"] == 64 and kw["max_model_len"] == TOY_CONTEXT
    assert engine.engine_kwargs(student, EngineConfig(cuda_graphs=False))["enforce_eager"] is True
    assert engine.engine_kwargs(student, EngineConfig(dtype="float16"))["dtype"] == "float16"
    fake_gpu(monkeypatch, bf16=False)  # e.g. a V100: auto falls back to fp32
    assert engine.engine_kwargs(student, EngineConfig())["dtype"] == "float32"


def test_make_llm_passes_the_settings_to_vllm(tiny_assets, monkeypatch):
    seen = {}

    class FakeLLM:
        def __init__(self, **kw):
            seen.update(kw, compile_disable=os.environ.get("TORCH_COMPILE_DISABLE"))

    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(engine, "cuda_available", lambda: False)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL", "TORCH_COMPILE_DISABLE"):  # restored after the test
        monkeypatch.delenv(name, raising=False)
    cfg = EngineConfig(max_model_len=32, kv_cache_gib=3, in_process=False)  # the in-process start is the next test's
    assert isinstance(engine.make_llm(str(tiny_assets / "student"), cfg, seed=5), FakeLLM)
    assert seen["max_model_len"] == 32 and seen["seed"] == 5 and seen["enable_chunked_prefill"] is False
    assert seen["kv_cache_memory_bytes"] == 3 * 2**30 and "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    # The engine's own processes inherit it while it starts: vLLM's compiled sampler helpers run eagerly.
    assert seen["compile_disable"] == "1" and "TORCH_COMPILE_DISABLE" not in os.environ


def test_an_in_process_engine_is_built_with_vllms_in_process_settings(tiny_assets, monkeypatch):
    """engine.in_process on CPU: vLLM's uniprocess executor, VLLM_ENABLE_V1_MULTIPROCESSING=0 while the
    engine is built (and as it was after), and vLLM's environment cache released so that a later engine
    of the process reads its own settings; on a GPU the setting changes nothing."""
    student = str(tiny_assets / "student")
    monkeypatch.setattr(engine, "cuda_available", lambda: False)
    built, released = [], []

    class FakeLLM:
        def __init__(self, **kw):
            built.append((kw.get("distributed_executor_backend"), os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")))

    fake = types.ModuleType("vllm")
    fake.LLM, fake.envs = FakeLLM, types.SimpleNamespace(disable_envs_cache=lambda: released.append(True))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    engine.make_llm(student, EngineConfig(max_model_len=32))  # the CPU default
    engine.make_llm(student, EngineConfig(max_model_len=32, in_process=False))
    assert built == [("uni", "0"), (None, None)] and released == [True]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    fake_gpu(monkeypatch)
    assert "distributed_executor_backend" not in engine.engine_kwargs(student, EngineConfig(in_process=True))


@pytest.mark.slow
def test_zero3_trains_in_a_process_whose_in_process_engine_has_shut_down(tiny_assets, tmp_path):
    """Two toy rounds in this process with in-process engines: a ZeRO-0 round, then a ZeRO-3 round. The
    first round's engine is collected when the second one starts, and its shutdown destroys every
    torch.distributed group of the process, DeepSpeed's clone of the world group among them (before the
    fix, ZeRO-3 then failed: "Group ... is not registered"). The ZeRO-3 round trains the same rows to
    the same weights as the ZeRO-0 one."""
    from safetensors.numpy import load_file

    from gndpo.apps.init import init_run
    from gndpo.pipeline.config.load import config_from_dict
    from gndpo.pipeline.run.run import open_run

    weights = {}
    for stage in (0, 3):
        url = str(tmp_path / f"zero{stage}")
        init_run(url, config_from_dict(tiny_config_dict(tiny_assets, train={"zero_stage": stage}, engine={"in_process": True})))
        run_stages(url, "rollout", "score", "normalize", "train")
        model_dir = open_run(url).records(0, "train").manifest().metrics["model_dir"]
        weights[stage] = load_file(str(Path(url) / model_dir / "model.safetensors"))
    assert committed_rows(tmp_path / "zero3") == committed_rows(tmp_path / "zero0")
    assert weights[3].keys() == weights[0].keys()
    for key in weights[0]:
        np.testing.assert_allclose(weights[3][key], weights[0][key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_each_engine_gets_its_own_kv_cache_size(tiny_assets, monkeypatch, caplog):
    """engine.kv_cache_gib reaches each engine as its own argument: a teacher engine started after a
    student engine in the same process gets the teacher's size, and the legacy VLLM_CPU_KVCACHE_SPACE
    (which vLLM would let override every engine's) is out of the environment while an engine starts,
    with a warning, and back after."""
    student, teacher = str(tiny_assets / "student"), str(tiny_assets / "teacher")
    monkeypatch.setattr(engine, "cuda_available", lambda: False)
    started = []

    class FakeLLM:
        def __init__(self, **kw):
            started.append((kw["model"], kw["kv_cache_memory_bytes"], os.environ.get("VLLM_CPU_KVCACHE_SPACE")))

    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    with caplog.at_level(logging.WARNING, logger="gndpo"):
        engine.make_llm(student, EngineConfig(max_model_len=32, kv_cache_gib=1, in_process=False))
        engine.make_llm(teacher, EngineConfig(max_model_len=32, kv_cache_gib=3, in_process=False), max_logprobs=64)
    assert started == [(student, 2**30, None), (teacher, 3 * 2**30, None)]
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "7"
    assert "VLLM_CPU_KVCACHE_SPACE=7 is ignored: engine.kv_cache_gib (3)" in caplog.text
    # On a GPU the share of its memory decides (gpu_memory_utilization), not a size.
    fake_gpu(monkeypatch)
    assert "kv_cache_memory_bytes" not in engine.engine_kwargs(student, EngineConfig(kv_cache_gib=3))


@pytest.mark.slow
def test_a_real_engine_has_the_configured_kv_cache(tiny_assets, monkeypatch):
    """One real CPU engine, started while VLLM_CPU_KVCACHE_SPACE says 2 GiB (as an earlier engine's or
    the user's environment would): it has the 1 GiB its config asks for, as many blocks as 1 GiB holds.
    Sampling with log-probs from it (in this process) compiles nothing: vLLM's compiled sampler helpers
    run eagerly on CPU."""
    from torch._dynamo.utils import counters
    from vllm import SamplingParams

    if torch.cuda.is_available():
        pytest.skip("the KV cache size is a CPU engine's setting")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    llm = engine.make_llm(str(tiny_assets / "student"), EngineConfig(max_model_len=32, kv_cache_gib=1))
    try:
        config = llm.llm_engine.vllm_config
        cache, model = config.cache_config, config.model_config
        assert cache.kv_cache_memory_bytes == 2**30
        per_token = 2 * model.get_num_kv_heads(config.parallel_config) * model.get_head_size() * torch.finfo(model.dtype).bits // 8
        per_block = cache.block_size * per_token * model.get_num_layers(config.parallel_config)
        assert cache.num_gpu_blocks == 2**30 // per_block
        frames = dict(counters["frames"])
        out = engine.generate(llm, [[1, 3, 4]], [SamplingParams(max_tokens=3, logprobs=2, seed=0)])
        assert len(out[0].token_ids) == 3 and all(lp < 0 for lp in out[0].logprobs)
        assert dict(counters["frames"]) == frames
    finally:
        engine.shutdown_llm(llm)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"


# -- gndpo init ---------------------------------------------------------------------------------------


def init_fails(tmp_path, cfg: dict, *overrides) -> str:
    """Run `gndpo init` (in process); it must fail with one `error:` line and write nothing."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    line = assert_one_line_error(invoke("init", run, "--config", path, *overrides))
    assert not run.exists()
    return line


def test_init_refuses_prompt_plus_max_tokens_beyond_the_models_context(tmp_path, tiny_assets):
    # The toy prompts are "ab+cd=" plus BOS: 7 tokens. max_model_len 0 = the model's own 64.
    line = init_fails(tmp_path, tiny_config_dict(tiny_assets), "engine.max_model_len=0", "rollout.max_tokens=60")
    assert "7 tokens" in line and "rollout.max_tokens 60" in line and "max_model_len 64" in line
    assert "lower rollout.max_tokens" in line and "raise engine.max_model_len" not in line  # 64 is already the most


def test_init_refuses_prompt_plus_max_tokens_beyond_max_model_len(tmp_path, tiny_assets):
    line = init_fails(tmp_path, tiny_config_dict(tiny_assets), "rollout.max_tokens=30")  # 7 + 30 > 32
    assert "7 tokens" in line and "rollout.max_tokens 30" in line and "max_model_len 32" in line
    assert "raise engine.max_model_len (at most 64" in line


def test_init_counts_a_long_heldout_prompt_without_tokenizer_warnings(tmp_path, tiny_assets):
    heldout = tmp_path / "heldout.jsonl"
    rows = [json.loads(x) for x in (tiny_assets / "heldout.jsonl").read_text().splitlines()]
    rows.append({"prompt": "1" * 70 + "+1=", "answer": "2"})  # 74 tokens: past the tokenizer's model_max_length
    heldout.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_config_dict(tiny_assets, data={"heldout": str(heldout)})
    line = init_fails(tmp_path, cfg)
    assert "data.heldout prompt (row " in line and ") has 74 tokens" in line


def test_init_refuses_max_model_len_beyond_the_model(tmp_path, tiny_assets):
    line = init_fails(tmp_path, tiny_config_dict(tiny_assets), "engine.max_model_len=128")
    assert "128" in line and "64" in line


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.dtype=fp8", "config key model.dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
        ("engine.dtype=half", "config key engine.dtype must be one of auto, float32, bfloat16, float16, got 'half'"),
        ("model.attn_implementation=flash", "config key model.attn_implementation must be one of sdpa, eager, flash_attention_2, got 'flash'"),
    ],
)
def test_init_refuses_unknown_precision_and_attention(tmp_path, tiny_assets, override, fragment):
    assert fragment in init_fails(tmp_path, tiny_config_dict(tiny_assets), override)


def test_init_accepts_a_fitting_config(tmp_path, tiny_assets):
    """The prompt and the response exactly fill the model's context."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tiny_assets)))
    invoke_ok("init", tmp_path / "run", "--config", path, "engine.max_model_len=0", "rollout.max_tokens=57")  # 7 + 57 = 64
    assert (tmp_path / "run/run.yaml").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_round_bench_refuses_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_round.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs an NVIDIA GPU" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_gpu_round_bench_config_passes_init(tmp_path, monkeypatch):
    """bench/gpu_round.py --dry-init: small realistic shapes, its config through `gndpo init`, no GPU.
    The script starts as a user starts it (--help); the dry init runs its main in this process, with its
    `gndpo init` process run here too (neither process is what is checked: the config is)."""
    script = ROOT / "bench" / "gpu_round.py"
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--dry-init" in proc.stdout
    spec = importlib.util.spec_from_file_location("gpu_round", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def init_here(*args, **_):
        result = invoke(*args)
        return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)

    monkeypatch.setattr(bench, "gndpo", init_here)
    out = tmp_path / "bench"
    bench.main(["--dry-init", "--out", str(out), "--prompts", "16", "--results", str(tmp_path / "r.json")])
    assert (out / "run" / "run.yaml").exists() and not (tmp_path / "r.json").exists()
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["train"]["zero_stage"] == 2 and cfg["model"]["dtype"] == "auto" and cfg["rollout"]["max_tokens"] == 1024


def test_gpu_round_bench_rehearses_the_hf_job_on_the_cpu(tmp_path, monkeypatch):
    """bench/gpu_round.py --backend hf --rounds 2 --rehearse: the job for a GPU machine without vLLM
    (rollout.backend hf, score.backend hf, DeepSpeed train, init's estimate for an 80 GiB GPU, one `gndpo
    run` of 2 rounds), on small shapes on the CPU, its commands in this process: every stage of both
    rounds is timed from the commit before it, beside init's estimate of its peak."""
    script = ROOT / "bench" / "gpu_round.py"
    spec = importlib.util.spec_from_file_location("gpu_round", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def here(*args, env=None, log=None):
        result = invoke(*args)
        return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)

    monkeypatch.setattr(bench, "gndpo", here)
    results = tmp_path / "r.json"
    bench.main(["--backend", "hf", "--rounds", "2", "--rehearse", "--out", str(tmp_path / "bench"), "--prompts", "8", "--n", "2",
                "--max-tokens", "16", "--results", str(results)])
    got = json.loads(results.read_text())
    assert got["config"]["rollout"]["backend"] == got["config"]["score"]["backend"] == "hf" and got["round"]["rehearsal"]
    assert got["init_estimate"]["gpu_gib"] == 80.0 and set(got["init_estimate"]["stages"]) == {"rollout", "score", "train"}
    stages = got["stages"]
    assert list(stages) == [f"r{r}/{s}" for r in range(2) for s in ("rollout", "score", "normalize", "train")]
    assert all(entry["seconds"] > 0 for entry in stages.values()) and stages["r1/rollout"]["rows"] == 16
    assert stages["r0/train"]["estimate_mib"] > 0 and stages["r1/rollout"]["metrics"]["policy_version"] == 1
    # The windows between commits lie within the run; each figure is rounded to 0.01 s.
    assert sum(entry["seconds"] for entry in stages.values()) <= got["total_seconds"] + 0.005 * (len(stages) + 1)


def test_shutting_down_an_in_process_engine_drops_what_shared_its_process_groups(monkeypatch):
    """A kept in-process engine that is replaced takes the process's torch.distributed groups with it:
    the kept teacher engine (in-process too) and the kept DeepSpeed engine are dropped with it, to be
    rebuilt when next asked for; an engine in processes of its own takes nothing with it."""
    from gndpo.stages.models import live as live_module

    stopped = []
    monkeypatch.setattr(live_module, "engine_processes", lambda llm: frozenset())
    monkeypatch.setattr(live_module, "in_process_engine", lambda llm: llm.startswith("in-process"))
    monkeypatch.setattr(live_module, "shutdown_llm", stopped.append)

    def kept(student: str, teacher: str) -> live_module.LiveModels:
        live = live_module.LiveModels(keep=True, log=lambda *_: None)
        live._engine = live_module._Engine(student, ("key",), "policy")
        live._teacher_engine = live_module._Engine(teacher, ("key",), "teacher")
        live._trainer = live_module._Trainer(object(), ("key",), "r0000/model")
        return live

    live = kept("in-process student", "in-process teacher")
    live.close_engine()
    assert stopped == ["in-process student", "in-process teacher"]
    assert live._engine is None and live._teacher_engine is None and live._trainer is None

    stopped.clear()
    live = kept("student in processes", "in-process teacher")
    live.close_engine()
    assert stopped == ["student in processes"]
    assert live._teacher_engine is not None and live._trainer is not None
    live.close()
    assert stopped == ["student in processes", "in-process teacher"] and live._trainer is None
