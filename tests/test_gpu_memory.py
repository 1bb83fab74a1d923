"""`gndpo init` sizes each stage's GPU memory (stages/models/gpu_memory.py) and refuses, in one line with the
setting to change, a stage that does not fit the GPU: this machine's, or `--gpu-memory` on a login node.
The estimate is held to the device check's measurements on an H200 (bench/results/gpu_check_2.json),
and run on a CPU machine against the GSM8K example's shapes (Qwen3-1.7B from Qwen3-8B)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.stages.models.gpu_memory import GIB, Shape, parse_memory, train_peak, train_ranks, uses_checkpointing
from gndpo.stages.models.loading import architecture_parameter_count
from tests.conftest import assert_one_line_error, invoke

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gsm8k-8b-to-1.7b.yaml"
MEASURED = Path(__file__).resolve().parent.parent / "bench" / "results" / "gpu_check_2.json"
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "max_position_embeddings": 40960,
         "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
SHAPES = {  # Qwen3-1.7B's and Qwen3-8B's config.json, the fields that decide their size
    "student": {**QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
                "tie_word_embeddings": True},
    "teacher": {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                "tie_word_embeddings": False},
}


def test_the_estimate_holds_to_the_h200_measurements():
    """One optimizer step of a random 1.72B Qwen3-shaped student, ZeRO-0, one full micro-batch: the
    estimate is at or above each measured peak (torch's allocated memory) and within 15% of it."""
    checks = json.loads(MEASURED.read_text())["checks"]
    student = Shape(1_720_574_976, 2048, 28)  # the check's build_engine step counted these parameters
    for name, settings in (("train_1p7b", {}), ("train_1p7b_8k", {"max_tokens_per_batch": 8192}),
                           ("train_1p7b_ckpt_live", {"gradient_checkpointing": True})):
        measured = checks[name]["peak_alloc_gib"]
        cfg = config_from_dict({"train": settings})
        estimate = train_peak(cfg, student, 140 * GIB, cfg.train.gradient_checkpointing is True).bytes / GIB
        assert measured <= estimate <= 1.15 * measured, (name, measured, estimate)


def test_zero_stages_split_their_shares_over_the_ranks():
    """From 1 to 8 ranks the step's peak (no checkpointing, a micro-batch's activations) loses the other
    7 ranks' shares of what each ZeRO stage partitions, in the measured bytes a parameter: nothing at
    ZeRO-0; AdamW's fp32 master weights and moments (12.1) at ZeRO-1; the bf16 gradients (2) too at
    ZeRO-2; the bf16 weights (2) too at ZeRO-3."""
    student = Shape(1_720_574_976, 2048, 28)
    partitioned = {0: 0.0, 1: 12.1, 2: 12.1 + 2.0, 3: 12.1 + 2.0 + 2.0}
    for stage, per_parameter in partitioned.items():
        cfg = config_from_dict({"train": {"zero_stage": stage}})
        one, eight = (train_peak(cfg, student, 80 * GIB, checkpointing=False, ranks=ranks) for ranks in (1, 8))
        assert one.bytes - eight.bytes == pytest.approx(student.parameters * per_parameter * 7 / 8, rel=1e-9), stage
        assert (" on 8 ranks (ZeRO-%d)" % stage) in eight.how and "ranks" not in one.how
    # What `gndpo run --gpus 8` gives train with train.num_processes 0: a rank a GPU, as init is told.
    assert train_ranks(config_from_dict({}), 8) == 8 and train_ranks(config_from_dict({}), 0) == 1
    assert train_ranks(config_from_dict({"train": {"num_processes": 2}}), 8) == 2


def test_memory_sizes_parse():
    assert parse_memory("80GiB") == 80 * GIB and parse_memory("80GB") == 80 * 10**9 and parse_memory("81559MiB") == 81559 * 2**20
    assert parse_memory("141") == 141 * GIB
    with pytest.raises(GndpoError, match="write a size such as 80GiB"):
        parse_memory("eighty")


@pytest.fixture
def example_shapes(tmp_path, tiny_assets) -> dict[str, Path]:
    """Folders with Qwen3-1.7B's and Qwen3-8B's configs, the toy's tokenizer and a token weight file:
    enough for init's checks, which read configs and tokenizers, never the weights."""
    folders = {}
    for role, config in SHAPES.items():
        folder = folders[role] = tmp_path / role
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tiny_assets / "student" / name, folder / name)
        save_file({"placeholder": torch.zeros(1)}, str(folder / "model.safetensors"))
    rows = [json.loads(line) for line in (tiny_assets / "train.jsonl").read_text().splitlines()]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    return folders


def init_example(tmp_path: Path, folders: dict, *settings: str):
    data = tmp_path / "gsm8k.jsonl"
    return invoke("init", tmp_path / "run", "--config", EXAMPLE, f"student={folders['student']}", f"teacher={folders['teacher']}",
                  f"data.train={data}", f"data.heldout={data}", "data.system_prompt=''", "rollout.prompts_per_round=16", *settings)


def test_the_gsm8k_example_fits_an_80gib_gpu_and_would_not_without_checkpointing(tmp_path, example_shapes, caplog):
    assert architecture_parameter_count(str(example_shapes["student"])) == pytest.approx(1.72e9, rel=0.01)
    assert architecture_parameter_count(str(example_shapes["teacher"])) == pytest.approx(8.19e9, rel=0.01)
    refused = init_example(tmp_path, example_shapes, "--gpu-memory", "80GiB", "train.gradient_checkpointing=false")
    line = assert_one_line_error(refused, "train needs about", "of the GPU's 80.0 GiB", "set train.max_tokens_per_batch to at most",
                                 "or train.gradient_checkpointing: true")
    assert "rollout 68.0, score" in line  # every stage's estimate, in the one line
    assert not (tmp_path / "run" / "run.yaml").exists()
    with caplog.at_level(logging.INFO, logger="gndpo"):
        accepted = init_example(tmp_path, example_shapes, "--gpu-memory", "80GiB")
    assert accepted.exit_code == 0, accepted.output
    estimates = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GPU memory per stage")]
    assert estimates and "estimated for a 80.0 GiB GPU: rollout 68.0, score" in estimates[0], estimates
    assert "train with gradient checkpointing" in estimates[0]  # the example leaves it to auto, which turns it on here


def test_auto_checkpoints_only_where_the_gpu_needs_it(example_shapes):
    """train.gradient_checkpointing: auto is on where the step without it is estimated above 70% of the
    GPU (the GSM8K example's 1.72B student: 80 GiB yes, a 1 TiB GPU no), off without a GPU; true and
    false are kept whatever the GPU."""
    student = str(example_shapes["student"])
    auto = config_from_dict({"train": {"max_tokens_per_batch": 16384}})
    assert auto.train.gradient_checkpointing == "auto"
    without = train_peak(auto, Shape.of(student), 80 * GIB, checkpointing=False).bytes
    assert without > 0.7 * 80 * GIB
    assert uses_checkpointing(auto, student, 80 * GIB) and not uses_checkpointing(auto, student, 1024 * GIB)
    assert not uses_checkpointing(auto, student, None)
    for setting in (True, False):
        cfg = config_from_dict({"train": {"gradient_checkpointing": setting}})
        assert uses_checkpointing(cfg, student, 80 * GIB) is setting and uses_checkpointing(cfg, student, 1024 * GIB) is setting


def test_auto_checkpointing_switches_at_seventy_percent(example_shapes):
    """train.gradient_checkpointing: auto on both sides of its threshold and at it: on a GPU where the
    step without checkpointing is 1% above 70% of it, on; at exactly 70%, off (above, not at); 1% below,
    off. The threshold is re-derived here from the step's estimate, not read from the module."""
    student = str(example_shapes["student"])
    auto = config_from_dict({"train": {"max_tokens_per_batch": 16384}})
    peak = train_peak(auto, Shape.of(student), 80 * GIB, checkpointing=False).bytes  # the estimate does not depend on the GPU's size
    assert train_peak(auto, Shape.of(student), 200 * GIB, checkpointing=False).bytes == peak
    at = peak / 0.70
    assert uses_checkpointing(auto, student, int(at / 1.01))  # the step is 1% above 70% of this GPU
    assert not uses_checkpointing(auto, student, int(at * 1.01))
    assert not uses_checkpointing(auto, student, int(at) + 1)


def test_a_bad_gpu_memory_is_one_line(tmp_path, example_shapes):
    assert_one_line_error(init_example(tmp_path, example_shapes, "--gpu-memory", "lots"), "--gpu-memory 'lots'")


def test_the_one_gpu_node_page_prints_what_init_prints(tmp_path, example_shapes, caplog):
    """docs/getting-started/one-gpu-node.md shows the estimate init prints for its config: init on the
    page's config (examples/one-gpu-node.yaml) with Qwen3-1.7B's and Qwen3-8B's shapes prints that line,
    number for number."""
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "getting-started" / "one-gpu-node.md").read_text()
    shown = re.search(r"^INFO (GPU memory per stage, .*)$", page, re.M).group(1)
    (tmp_path / "node.yaml").write_text((root / "examples" / "one-gpu-node.yaml").read_text())  # the page's copy is held to it
    with caplog.at_level(logging.INFO, logger="gndpo"):
        result = invoke("init", tmp_path / "run", "--config", tmp_path / "node.yaml", "--gpu-memory", "80GiB", "--gpus", "8",
                        f"student={example_shapes['student']}", f"teacher={example_shapes['teacher']}",
                        f"data.train={tmp_path / 'gsm8k.jsonl'}", "data.prompt_key=question", "rollout.prompts_per_round=16")
    assert result.exit_code == 0, result.output
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("GPU memory per stage")] == [shown]
