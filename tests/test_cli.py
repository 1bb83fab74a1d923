"""CLI behaviour without models running: config handling and user errors.

Every user mistake must give one line on stderr, a non-zero exit, and leave no committed output.
"""

import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gndpo.apps.demo import DEFAULT_CONFIG
from gndpo.cli.app import app, register
from gndpo.pipeline.config.load import load_config
from gndpo.pipeline.settings.schema import Config
from tests.conftest import invoke_ok, tiny_config_dict

register()
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for frag in fragments:
        assert frag in lines[0]


def write_config(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_default_demo_config_parses_with_every_section():
    cfg = load_config(str(DEFAULT_CONFIG))
    assert isinstance(cfg, Config)
    assert cfg.method.name == "gndpo" and cfg.method.policy_loss == "gspo"


def test_overrides_are_typed(tmp_path):
    cfg = load_config(None, ["train.lr=1e-4", "rollout.n=3", "method.name=opd"])
    assert cfg.train.lr == 1e-4 and cfg.rollout.n == 3 and cfg.method.name == "opd"


def test_init_creates_a_run_and_is_idempotent(tmp_path, tiny_config):
    run = tmp_path / "run"
    assert invoke("init", run, "--config", tiny_config).exit_code == 0
    assert (run / "run.yaml").exists() and (run / "prompts/train.parquet").exists()
    assert invoke("init", run, "--config", tiny_config).exit_code == 0
    result = invoke("init", run, "--config", tiny_config, "train.lr=0.5")
    assert_one_line_error(result, "another config")


@pytest.mark.parametrize(
    "content, fragment",
    [
        ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n', "malformed prompts file"),
        ('{"question": "1+1=", "answer": "2"}\n', "no 'prompt' column"),
        ("", "malformed prompts file"),
    ],
)
def test_bad_prompts_file(tmp_path, tiny_assets, content, fragment):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    cfg = tiny_config_dict(tiny_assets)
    cfg["data"]["train"] = str(bad)
    run = tmp_path / "run"
    assert_one_line_error(invoke("init", run, "--config", write_config(tmp_path, cfg)), fragment)
    assert not run.exists()


def test_missing_prompts_file_and_model(tmp_path, tiny_assets):
    cfg = tiny_config_dict(tiny_assets)
    cfg["data"]["heldout"] = str(tmp_path / "nope.jsonl")
    assert_one_line_error(invoke("init", tmp_path / "r1", "--config", write_config(tmp_path, cfg)), "not found")
    cfg = tiny_config_dict(tiny_assets, student=str(tmp_path / "no-model"))
    assert_one_line_error(invoke("init", tmp_path / "r2", "--config", write_config(tmp_path, cfg)), "student model path does not exist")
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_a_cross_tokenizer_teacher_without_a_chat_template_is_named_at_init(tmp_path, tiny_assets, other_tokenizer_teacher):
    """A student that reads prompts through its chat template and a cross-tokenizer teacher that has none
    (a user's Gemma teacher passed without a word): init warns, naming the teacher."""
    from transformers import AutoTokenizer

    student = tmp_path / "chat-student"
    shutil.copytree(tiny_assets / "student", student)
    tok = AutoTokenizer.from_pretrained(student)
    tok.chat_template = "{{ messages[-1]['content'] }}"
    tok.save_pretrained(student)
    teacher = tmp_path / "bare-teacher"
    shutil.copytree(other_tokenizer_teacher, teacher, ignore=shutil.ignore_patterns("chat_template.jinja"))
    tok = AutoTokenizer.from_pretrained(teacher)
    tok.chat_template = None
    tok.save_pretrained(teacher)
    assert AutoTokenizer.from_pretrained(teacher).chat_template is None
    cfg = tiny_config_dict(tiny_assets, student=str(student), teacher=str(teacher), score={"cross_tokenizer": True})
    result = invoke_ok("init", tmp_path / "run", "--config", write_config(tmp_path, cfg))
    assert [line.split("WARNING ", 1)[1] for line in result.stderr.splitlines() if "has no chat template" in line] == [
        f"teacher {teacher} has no chat template: it reads each prompt as bare text while the student reads it "
        "through its chat template; add one to its tokenizer_config.json if it is a chat model"]


def test_teacher_with_another_tokenizer_is_refused(tmp_path, tiny_assets, other_tokenizer_teacher):
    cfg = tiny_config_dict(tiny_assets, teacher=str(other_tokenizer_teacher))
    run = tmp_path / "run"
    assert_one_line_error(invoke("init", run, "--config", write_config(tmp_path, cfg)), "tokenizer differs", "set score.cross_tokenizer: true")
    assert not run.exists()


def test_config_errors(tmp_path):
    assert_one_line_error(invoke("init", tmp_path / "r", "--config", write_config(tmp_path, {"trian": {}})), "unknown config key trian")
    assert_one_line_error(invoke("init", tmp_path / "r", "--config", tmp_path / "missing.yaml"), "config file not found")
    assert_one_line_error(invoke("init", tmp_path / "r", "rollout.n=many"), "rollout.n must be int")
    assert_one_line_error(invoke("init", tmp_path / "r", "method.name=dpo"), "config key method.name must be one of", "got 'dpo'")
    assert_one_line_error(invoke("init", tmp_path / "r", "method.name=gdpo", "method.outcome.rewards=[nope]"), "unknown reward 'nope'")
    assert not (tmp_path / "r").exists()


def test_stage_commands_refuse_missing_runs_and_out_of_order_rounds(tmp_path, tiny_config):
    assert_one_line_error(invoke("rollout", tmp_path / "none", "--round", 0), "not a gndpo run")
    run = tmp_path / "run"
    assert invoke("init", run, "--config", tiny_config).exit_code == 0
    assert_one_line_error(invoke("score", run, "--round", 0), "rollout of round 0 is not committed")
    assert_one_line_error(invoke("rollout", run, "--round", 1), "train of round 0 is not committed")


def test_status_and_sql_on_a_fresh_run(tmp_path, tiny_config):
    run = tmp_path / "run"
    invoke("init", run, "--config", tiny_config)
    assert invoke("status", run).exit_code == 0
    result = invoke("sql", run, "SELECT count(*) AS n FROM rollouts", "--format", "csv")
    assert result.exit_code == 0 and result.stdout.strip().splitlines() == ["n", "0"]
    assert_one_line_error(invoke("sql", run, "COPY (SELECT 1) TO 'x.csv'"), "read-only")
    assert_one_line_error(invoke("sql", run, "CREATE TABLE t (x INT)"), "read-only")
    assert_one_line_error(invoke("sql", run, "SELECT * FROM nope"), "SQL error")
    assert not (Path.cwd() / "x.csv").exists()


def test_the_reports_heldout_axis_names_the_runs_reward(tmp_path, tiny_assets):
    """The held-out curve's unit is the run's reward: "exact match" only where that is the reward
    (it said "exact match" for a user's custom reward)."""
    from gndpo.apps.report import Series, heldout_label

    labels = []
    for reward in ("exact_match", "integer_format"):
        invoke_ok("init", tmp_path / reward, "--config", write_config(tmp_path, tiny_config_dict(tiny_assets, reward=reward)))
        labels.append(heldout_label([Series(reward, str(tmp_path / reward), [])]))
    assert labels == ["exact match", "mean integer_format reward"]


def test_eval_needs_a_model_or_run(tmp_path, tiny_assets):
    assert_one_line_error(invoke("eval", tmp_path / "nothing"), "does not exist")
    assert_one_line_error(invoke("eval", tiny_assets / "student"), "needs --prompts")


# Each refused by `gndpo init` with one line naming the key, before anything is written. With the tiny
# config every other check passes, so the refusal comes from the value itself. Ranges here; choices,
# types and method settings: tests/test_config.py.
BAD_VALUES = [
    ("rollout.n=-3", "rollout.n must be >= 1"),
    ("rollout.n=0", "rollout.n must be >= 1"),
    ("rollout.temperature=0", "rollout.temperature must be > 0"),
    ("rollout.prompts_per_round=0", "rollout.prompts_per_round must be >= 1"),
    ("rollout.prompts_per_unit=0", "rollout.prompts_per_unit must be >= 1"),
    ("rollout.max_tokens=0", "rollout.max_tokens must be >= 1"),
    ("rollout.top_p=0", "rollout.top_p must be > 0 and <= 1"),
    ("rollout.top_p=1.5", "rollout.top_p must be > 0 and <= 1"),
    ("rollout.top_k=0", "rollout.top_k must be -1 (off) or >= 1"),
    ("rollout.guided_fraction=1.2", "rollout.guided_fraction must be >= 0 and <= 1"),
    ("train.zero_stage=7", "train.zero_stage must be >= 0 and <= 3"),
    ("train.lr=0", "train.lr must be > 0"),
    ("train.lr=-1e-5", "train.lr must be > 0"),
    ("train.optimizer_steps=0", "train.optimizer_steps must be >= 1"),
    ('rollout.stop=[""]', "rollout.stop must be a list of non-empty strings"),
    ("train.micro_batch_size=0", "train.micro_batch_size must be >= 1"),
    ("train.max_tokens_per_batch=-1", "train.max_tokens_per_batch must be >= 1"),
    ("train.checkpoint_every=-2", "train.checkpoint_every must be >= 0"),
    ("train.grad_clip=-1", "train.grad_clip must be >= 0"),
    ("score.teacher_topk=0", "score.teacher_topk must be >= 1"),
    ("score.rows_per_chunk=0", "score.rows_per_chunk must be >= 1"),
    ("model.token_chunk=0", "model.token_chunk must be >= 1"),
    ("engine.max_model_len=4", "engine.max_model_len"),
    ("engine.max_model_len=-1", "engine.max_model_len must be >= 0"),
    ("engine.gpu_memory_utilization=1.5", "engine.gpu_memory_utilization must be > 0 and <= 1"),
    ("engine.tensor_parallel_size=0", "engine.tensor_parallel_size must be >= 1"),
    ("method.clamp=0", "method.clamp must be > 0"),
    ("method.reward_beta=-0.5", "method.reward_beta must be >= 0"),
    ("method.jsd_beta=1", "method.jsd_beta must be > 0 and < 1"),
    ("method.tip.keep_ratio=0", "method.tip.keep_ratio must be > 0 and <= 1"),
    ("method.reopold.lam=1", "method.reopold.lam must be > 0 and < 1"),
]


@pytest.mark.parametrize("override, fragment", BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_init_refuses_bad_values_before_writing(tmp_path, tiny_config, override, fragment):
    run = tmp_path / "run"
    assert_one_line_error(invoke("init", run, "--config", tiny_config, override), fragment)
    assert not run.exists()


@pytest.mark.parametrize("name", ["gsm8k-8b-to-1.7b.yaml", "own-chat-data.yaml", "own-chat-data-gdpo.yaml"])
def test_example_configs_parse(name):
    """The examples' configs are valid configs (their models and data live elsewhere)."""
    cfg = load_config(str(Path(__file__).parent.parent / "examples" / name))
    assert cfg.data.chat_template == "auto" and cfg.rollout.max_tokens >= 1024


def test_example_reward_is_a_reward(monkeypatch):
    from gndpo.pipeline.tasks.rewards import get_reward

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "examples"))
    reward = get_reward("my_rewards:contains_reference")
    assert reward("The capital is Paris.", {"answer": "paris"}) == 1.0 and reward("Lyon", {"answer": "paris"}) == 0.0


def test_compare_stability_figures():
    """The gradient-norm figures of some optimizer steps, against hand computation: the 99th percentile
    interpolates between the two largest norms, a step counts as clipped when its norm exceeds the clip,
    and without a clip there is no clipped share."""
    from gndpo.apps.compare import stability

    got = stability([0.5, 2.0, 1.0, 3.0], grad_clip=1.0)
    # sorted 0.5, 1, 2, 3: the 99th percentile sits at position 0.99 * 3 = 2.97, 97% of the way from 2 to 3
    assert got["grad_norm_p99"] == pytest.approx(2.97) and got["grad_norm_max"] == 3.0
    assert got["clipped_steps"] == 0.5  # 2.0 and 3.0 exceed 1.0; 1.0 itself does not
    assert got["grad_norm_std"] == pytest.approx(((0.5 - 1.625) ** 2 + 0.375**2 + 0.625**2 + 1.375**2) ** 0.5 / 2)
    assert stability([0.5, 2.0], grad_clip=0.0)["clipped_steps"] is None
    assert set(stability([], grad_clip=1.0).values()) == {None}


def test_compare_folders_and_table_with_and_without_seeds(tmp_path):
    """One seed keeps a method's demo in <index>-<method>/; several put each seed in seed-<s>/ inside
    it. The Markdown shows a column with a _sd partner as mean ± sd."""
    from gndpo.apps.compare import markdown_table, method_folder, seed_mean

    assert method_folder(tmp_path, 1, "gdpo+method.x=1", 0, 1) == tmp_path / "01-gdpo"
    assert method_folder(tmp_path, 1, "gdpo+method.x=1", 2, 3) == tmp_path / "01-gdpo" / "seed-2"
    row = seed_mean([{"method": "opd", "seed": 0, "acc_r0": 0.2, "adv_min": None}, {"method": "opd", "seed": 1, "acc_r0": 0.4, "adv_min": -1.0}])
    assert row["acc_r0"] == pytest.approx(0.3) and row["acc_r0_sd"] == pytest.approx(0.1414213562) and row["adv_min"] is None
    assert markdown_table([row]).splitlines()[2] == "| opd | 2 | 0.300 ± 0.141 | - |"
    assert markdown_table([{"method": "opd", "acc_r0": 0.25}]).splitlines()[2] == "| opd | 0.250 |"
