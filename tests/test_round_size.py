"""What `gndpo init` estimates a round writes and holds (gndpo.apps.round_size), re-derived here
from the toy model's own weights and the stored columns' widths, and the sizes it refuses or warns
about; the estimate against a real round's bytes is checked in test_e2e."""

import logging

import pytest
import yaml

from gndpo.apps import round_size
from gndpo.pipeline.config.load import config_from_dict
from gndpo.storage.step_files import BUFFER_BYTES
from tests.conftest import assert_one_line_error, invoke, tiny_config_dict


def toy_weights(assets) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets / "student")
    return sum(t.numel() for t in model.state_dict().values())


@pytest.mark.parametrize("method, per_token", [
    # student and teacher log-prob (4 + 4); a top-k method adds k ids and k log-probs (4 + 4 each) and
    # the rest mass (4)
    ("gndpo", 8), ("reverse_kl", 8 + 5 * 8 + 4),
])
def test_the_estimate_is_the_rows_weights_and_state_a_round_writes(tiny_assets, method, per_token):
    cfg = config_from_dict(tiny_config_dict(tiny_assets, method={"name": method}, score={"teacher_topk": 5},
                                            train={"optimizer_steps": 7, "checkpoint_every": 3}))
    size = round_size.estimate_round(cfg, longest_prompt=11)
    rows, tokens = 16 * 2, 16 * 2 * 5  # prompts_per_round x n, x max_tokens
    # rollout: per prompt token its 4-byte id and 4 bytes of text; per response token its id (4), loss
    # mask (1), sampler log-prob (4) and text (4)
    # and a footer per shard: a rollout and a score shard for each of the 2 units (8 prompts each)
    assert size.shard_bytes == rows * 11 * (4 + 4) + tokens * (9 + 4) + tokens * per_token + 4 * 10_000
    weights = toy_weights(tiny_assets)
    assert size.weights == weights and size.export_bytes == 4 * weights  # fp32 on a CPU
    # AdamW's state: fp32 weights and two fp32 moments; two in-round checkpoints (after steps 3 and 6)
    assert size.state_bytes == 3 * (4 + 8) * weights


def test_a_student_without_safetensors_leaves_out_export_and_state(tiny_assets, tmp_path):
    import shutil

    student = tmp_path / "student"
    shutil.copytree(tiny_assets / "student", student, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = config_from_dict(tiny_config_dict(tiny_assets, student=str(student)))
    size = round_size.estimate_round(cfg, longest_prompt=11)
    assert size.weights is None and size.export_bytes == size.state_bytes == 0 and size.disk_bytes == size.shard_bytes


def init_with(tmp_path, assets, monkeypatch, free=None, memory=None):
    monkeypatch.setattr(round_size, "free_bytes", lambda url: free)
    monkeypatch.setattr(round_size, "available_memory", lambda: memory)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(assets)))
    return invoke("init", tmp_path / "run", "--config", config)


def test_init_refuses_a_round_beyond_the_free_space_and_says_its_estimate(tiny_assets, tmp_path, monkeypatch):
    weights = toy_weights(tiny_assets)
    line = assert_one_line_error(init_with(tmp_path, tiny_assets, monkeypatch, free=100_000),
                                 "one round writes up to", "100 kB free where the run folder is", "lower rollout.prompts_per_round")
    assert f"{weights:,} weights: export {round_size.readable_size(4 * weights)}" in line and not (tmp_path / "run").exists()


def test_init_refuses_rows_beyond_the_available_memory(tiny_assets, tmp_path, monkeypatch):
    assert_one_line_error(init_with(tmp_path, tiny_assets, monkeypatch, memory=1000),
                          "train holds up to", "of the round's rows in memory", "1 kB this machine has available")
    assert not (tmp_path / "run").exists()


def test_a_round_that_takes_more_than_half_gets_a_warning_and_runs(tiny_assets, tmp_path, monkeypatch, caplog):
    need = round_size.estimate_round(config_from_dict(tiny_config_dict(tiny_assets)), longest_prompt=1).disk_bytes
    with caplog.at_level(logging.WARNING, logger="gndpo"):
        result = init_with(tmp_path, tiny_assets, monkeypatch, free=int(need * 1.5))
    assert result.exit_code == 0, result.output
    assert "more than half of the" in caplog.text and (tmp_path / "run" / "run.yaml").is_file()


def test_readable_sizes():
    assert [round_size.readable_size(n) for n in (12, 2_122_491, 84e9, 1.6e12)] == ["12 B", "2.12 MB", "84 GB", "1.6 TB"]


def example_round(assets, steps: int) -> round_size.RoundSize:
    """The docs' example round: 4,096 prompts x 16 samples x 2,048 tokens, a top-64 method, prompts of 256 tokens."""
    cfg = config_from_dict(tiny_config_dict(assets, method={"name": "reverse_kl"}, score={"teacher_topk": 64},
                                            rollout={"prompts_per_round": 4096, "n": 16, "max_tokens": 2048, "prompts_per_unit": 64},
                                            train={"optimizer_steps": steps}))
    return round_size.estimate_round(cfg, longest_prompt=256)


def test_train_holds_a_unit_or_two_mini_batches_of_rows_not_the_round(tiny_assets):
    size = example_round(tiny_assets, steps=128)  # 512 responses per step
    rows_bytes = size.shard_bytes - 2 * 64 * 10_000  # less the shards' footers
    assert 72e9 < rows_bytes < 73e9
    unit, step = -(-rows_bytes // 64), -(-rows_bytes // 128)
    assert (size.unit_bytes, size.step_bytes) == (unit, step)
    assert size.held_bytes == max(unit + BUFFER_BYTES, 2 * step) < 1.5e9
    assert size.step_file_bytes == size.shard_bytes  # past the buffer the rows go to the step file

    # accepted where the disk holds the round and its step files; refused where it does not, or where a step is the round
    round_size.check_round_size(size, free=100e9, memory=16e9, temp=(200e9, False))
    round_size.check_round_size(size, free=200e9, memory=16e9, temp=(200e9, True))
    both = round_size.readable_size(size.disk_bytes + size.step_file_bytes)
    assert both.endswith(" GB") and 140 < float(both.split()[0]) < 150
    with pytest.raises(round_size.GndpoError, match=f"one round writes up to {both} .* more than the 100 GB free where the run folder is"):
        round_size.check_round_size(size, free=100e9, memory=16e9, temp=(100e9, True))
    with pytest.raises(round_size.GndpoError, match="step files take up to 72.2 GB, more than the 10 GB free .* set TMPDIR"):
        round_size.check_round_size(size, free=100e9, memory=16e9, temp=(10e9, False))
    whole = example_round(tiny_assets, steps=1)
    with pytest.raises(round_size.GndpoError, match=r"two mini-batches of 65536 responses, 72.2 GB each.*raise train.optimizer_steps"):
        round_size.check_round_size(whole, free=200e9, memory=16e9, temp=(200e9, False))
