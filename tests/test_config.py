"""Settings are checked once, when the config is read: `gndpo init` (and `gndpo fork`) refuses a bad
choice, a mistyped value or a method setting that cannot work in one line naming the key, before
anything is written, so no stage ever finds a bad setting hours into a run. A Config is frozen.

Ranges are tested in tests/test_cli.py (BAD_VALUES); here are the choices, the types of values, lists
and mappings, and the method settings that used to be refused only at normalize or train.
"""

import dataclasses
import math
import typing

import pytest
import yaml
from typer.testing import CliRunner

from gndpo.apps.init import init_run
from gndpo.cli.app import app, register
from gndpo.errors import GndpoError
from gndpo.pipeline.config.keys import describe_type
from gndpo.pipeline.config.load import config_from_dict, config_to_yaml, load_config
from gndpo.pipeline.methods import METHODS, validate
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.train import round_lr
from tests.conftest import tiny_config_dict, write_config

register()
runner = CliRunner()


def refusal(*args) -> str:
    """The one line a refused command prints (it must exit non-zero, print nothing else on stderr)."""
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# (overrides, what the one line says). Each is refused with the tiny config, whose every other check passes.
REFUSED = [
    # Method settings that init used to accept and normalize or train refused.
    ("method.tropd.outlier=drop", "config key method.tropd.outlier must be one of mask, clip, fkl, got 'drop'"),
    ("method.tropd.base=x", "config key method.tropd.base must be one of opd, gndpo, got 'x'"),
    ("method.outcome.gdpo_batch_norm=x", "config key method.outcome.gdpo_batch_norm must be one of sequence, token, got 'x'"),
    ("method.minillm_gamma=1.5", "config key method.minillm_gamma must be > 0 and <= 1, got 1.5"),
    ("method.minillm_gamma=0", "config key method.minillm_gamma must be > 0 and <= 1, got 0"),
    ("method.topk_form=x", "config key method.topk_form must be one of bucket, renormalized, got 'x'"),
    ("score.teacher_mix=x", "config key score.teacher_mix must be one of route, mean, got 'x'"),
    # The other choices.
    ("data.chat_template=chatml", "config key data.chat_template must be one of auto, none, got 'chatml'"),
    ("rollout.truncated=cut", "config key rollout.truncated must be one of keep, mask, drop, got 'cut'"),
    ("score.dtype=float16", "config key score.dtype must be one of float32, bfloat16, got 'float16'"),
    ("score.backend=tgi", "config key score.backend must be one of hf, vllm, server, got 'tgi'"),
    ("method.stats_scope=prompt", "config key method.stats_scope must be one of global, teacher, got 'prompt'"),
    ("self_teacher.weights=average", "config key self_teacher.weights must be one of frozen, live, ema, got 'average'"),
    ("logging.wandb_mode=disabled", "config key logging.wandb_mode must be one of online, offline, got 'disabled'"),
    ("model.dtype=fp8", "config key model.dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
    ("engine.dtype=half", "config key engine.dtype must be one of auto, float32, bfloat16, float16, got 'half'"),
    ("model.attn_implementation=flash", "config key model.attn_implementation must be one of sdpa, eager, flash_attention_2, got 'flash'"),
    ("method.policy_loss=dpo", "config key method.policy_loss must be one of '', gspo, ppo, reinforce, is, none, got 'dpo'"),
    ("method.loss_agg=sum", "config key method.loss_agg must be one of '', seq-mean-token-mean, token-mean, got 'sum'"),
    ("method.name=dpo", "config key method.name must be one of opd, gndpo, tinker, minillm, reverse_kl"),
    ("logging.backends=[tensorboard, tb]", "config key logging.backends must be a list of (tensorboard | wandb), got ['tensorboard', 'tb']"),
    # Types: a list or a mapping where a string is expected, and the other way round.
    ("student=[a, b]", "config key student must be str, got ['a', 'b']"),
    ("data.prompt_key={a: b}", "config key data.prompt_key must be str, got {'a': 'b'}"),
    ("method.tropd.outlier=[mask]", "config key method.tropd.outlier must be one of mask, clip, fkl, got ['mask']"),
    ("rollout.stop=abc", "config key rollout.stop must be a list of str, got 'abc'"),
    ("rollout.stop=[1, 2]", "config key rollout.stop must be a list of str, got [1, 2]"),
    ("logging.backends=tensorboard", "config key logging.backends must be a list of (tensorboard | wandb), got 'tensorboard'"),
    ("method.outcome.rewards=exact_match", "config key method.outcome.rewards must be a list of str, got 'exact_match'"),
    ("method.outcome.weights=[1, heavy]", "config key method.outcome.weights must be a list of float, got [1, 'heavy']"),
    ("method.outcome.weights=[true]", "config key method.outcome.weights must be a list of float, got [True]"),
    ("teachers=[a, b]", "config key teachers must be a mapping of str to str, got ['a', 'b']"),
    ("teacher_context.messages=[{role: user}]",
     "config key teacher_context.messages must be a list of {role: str, content: str}, got [{'role': 'user'}]"),
    ("teacher_context.messages={role: user, content: hi}", "config key teacher_context.messages must be a list of {role: str, content: str}"),
    ("data.template_kwargs=[enable_thinking]", "config key data.template_kwargs must be a mapping with str keys, got ['enable_thinking']"),
    ("rollout.n=2.5", "config key rollout.n must be int, got 2.5"),
    ("rollout.n=true", "config key rollout.n must be int, got True"),
    ("rollout.eval_heldout=maybe", "config key rollout.eval_heldout must be bool, got 'maybe'"),
    ("train.lr=fast", "config key train.lr must be float, got 'fast'"),
    ("rollout=3", "config section rollout must be a mapping, got int"),
    # What the schema cannot declare: methods.validate, and settings that contradict each other.
    ("method.schedule=fkl:two", "method.schedule: bad entry 'fkl:two'"),
    (("method.name=gdpo", "method.outcome.rewards=[exact_match]", "method.outcome.weights=[1, 2]"),
     "method.outcome.weights must be 1 numbers, one per reward, got [1, 2]"),
    (("method.name=grpo", "method.outcome.rewards=[]"), "method.outcome.rewards is empty"),
    ("method.stats_scope=teacher", "method.stats_scope teacher needs several teachers routed by prompt"),
    # The rollout engine's log-probs stand in for the student's forward only where they are the same numbers.
    (["score.student_logprobs=engine", "rollout.temperature=0.7"],
     "score.student_logprobs engine cannot be used with rollout.temperature 0.7 (vLLM returns the temperature-1"),
    (["score.student_logprobs=engine", "method.tip.enabled=true"], "score.student_logprobs engine cannot be used with method gndpo (it reads the student"),
    (["score.student_logprobs=engine", "rollout.guided_fraction=0.5"], "score.student_logprobs engine cannot be used with rollout.guided_fraction"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=[o if isinstance(o, str) else " ".join(o) for o, _ in REFUSED])
def test_init_refuses_in_one_line_before_writing(tmp_path, tiny_assets, overrides, message):
    run = tmp_path / "run"
    config = write_config(tmp_path, tiny_config_dict(tiny_assets))
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    line = refusal("init", run, "--config", config, *overrides)
    assert line.startswith("error: ") and message in line, line
    assert not run.exists()


@pytest.mark.parametrize("override, message", [
    ("method.tropd.outlier=drop", "config key method.tropd.outlier must be one of mask, clip, fkl, got 'drop'"),
    ("method.name=dpo", "config key method.name must be one of opd, gndpo"),
    ("method.schedule=rkl", "method.schedule: bad entry 'rkl'"),
])
def test_fork_refuses_in_one_line_before_writing(tmp_path, tiny_assets, override, message):
    parent = tmp_path / "parent"
    init_run(str(parent), load_config(str(write_config(tmp_path, tiny_config_dict(tiny_assets)))))
    open_run(str(parent)).records(0, "rollout").create_manifest({"units": [], "metrics": {}})
    line = refusal("fork", parent, tmp_path / "new", "--from-round", 0, override)
    assert message in line, line
    assert not (tmp_path / "new").exists()


def declared_settings() -> list[tuple[str, object]]:
    """(dotted key, declared type without its range) of every setting, walking the schema."""
    found = []

    def walk(cls, where):
        for name, typ in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(typ):
                walk(typ, f"{where}{name}.")
            else:
                found.append((f"{where}{name}", typ))

    walk(Config, "")
    return found


def literal_settings():
    """(dotted key, choices) of every setting declared with its choices."""
    return [(key, typing.get_args(typ)) for key, typ in declared_settings() if typing.get_origin(typ) is typing.Literal]


def nested(key: str, value) -> dict:
    *sections, last = key.split(".")
    out = {last: value}
    for section in reversed(sections):
        out = {section: out}
    return out


def test_every_declared_choice_is_accepted_and_nothing_else():
    declared = dict(literal_settings())
    assert {"data.chat_template", "rollout.truncated", "score.dtype", "score.backend", "score.teacher_mix",
            "method.stats_scope", "self_teacher.weights", "logging.wandb_mode", "model.dtype", "engine.dtype",
            "model.attn_implementation", "method.tropd.base", "method.tropd.outlier", "method.outcome.gdpo_batch_norm",
            "method.topk_form", "method.policy_loss", "method.loss_agg", "score.engine.dtype"} <= set(declared)
    routed = {"teacher": "", "teachers": {"a": "x", "b": "y"}}  # method.stats_scope teacher needs them
    for key, choices in declared.items():
        for choice in choices:
            data = nested(key, choice)
            if key == "method.stats_scope" and choice == "teacher":
                data = {**data, **routed}
            elif key == "score.backend" and choice == "server":  # it needs its servers
                data = {"score": {"backend": "server", "servers": ["http://127.0.0.1:8000"]}}
            cfg = config_from_dict(data)
            section = cfg
            for part in key.split("."):
                section = getattr(section, part)
            assert section == choice
        with pytest.raises(GndpoError, match=f"config key {key} must be one of"):
            config_from_dict(nested(key, "not-a-choice"))
    for name in METHODS:
        validate(config_from_dict({"method": {"name": name}}).method)


# For each scalar type, values YAML reads as another type that a lax validator would convert (1 ->
# True, "no" -> False, "3" -> 3, 2.0 -> 2, True -> 1 or 1.0, True -> "True"): each must be refused.
NOT_OF_TYPE = {bool: [1, 0, 1.0, "1", "true", "false", "yes", "no", "on", "off"], int: ["3", 2.0, True, False],
               float: [True, False], str: [True, False]}


def test_every_bool_int_float_and_str_setting_refuses_a_value_of_another_type():
    """Strict types across the schema, found by walking it (a setting added later is covered): every
    bool setting (and one that is a bool or a choice) refuses 1, 0, "yes", "no" and their kin; every int
    (a count, a bound) refuses "3", 2.0 and True; a float refuses True; a string refuses True. Each is
    one line naming the key and the value."""
    typed = [(key, typ) for key, typ in declared_settings() if typ in NOT_OF_TYPE or bool in typing.get_args(typ)]
    kinds = [typ for _, typ in typed]
    assert kinds.count(bool) >= 15 and kinds.count(int) >= 30 and kinds.count(float) >= 35 and kinds.count(str) >= 15, kinds
    assert "train.gradient_checkpointing" in dict(typed)  # bool | Literal["auto"]
    for key, typ in typed:
        for value in NOT_OF_TYPE.get(typ, NOT_OF_TYPE[bool]):
            with pytest.raises(GndpoError) as refused:
                config_from_dict(nested(key, value))
            line = str(refused.value)
            what = typ.__name__ if typ in NOT_OF_TYPE else describe_type(typ)
            assert line == f"config key {key} must be {what}, got {value!r}", line


def test_defaults_pass_the_schema_and_a_config_reads_back_with_its_fingerprint():
    """Every default is a value the schema accepts, and a run's frozen run.yaml reads back to the same
    config (and fingerprint, the run's identity)."""
    assert config_from_dict(dataclasses.asdict(Config())) == Config()
    cfg = config_from_dict({
        "method": {"name": "gdpo", "outcome": {"rewards": ["exact_match", "integer_format"], "weights": [1, 0.5]}},
        "teacher_context": {"messages": [{"role": "user", "content": "{prompt} solved: {solution}"}]},
        "data": {"template_kwargs": {"enable_thinking": False}}, "rollout": {"stop": ["\n\n"]},
        "logging": {"backends": ["tensorboard"]},
    })
    again = config_from_dict(yaml.safe_load(config_to_yaml(cfg)))
    assert again == cfg and again.fingerprint() == cfg.fingerprint()
    # Items of lists are checked, never converted: [1, 0.5] stays [1, 0.5], so the fingerprint of a
    # config is the same as before the items were typed.
    weights = cfg.method.outcome.weights
    assert weights == [1, 0.5] and type(weights[0]) is int


def test_a_config_is_frozen_and_load_config_resolves_paths_without_changing_it(tmp_path):
    (tmp_path / "models").mkdir()
    path = write_config(tmp_path, {"student": "models", "teacher": "Qwen/Qwen3-0.6B", "data": {"train": "./t.jsonl"}})
    cfg = load_config(str(path))
    assert cfg.student == str(tmp_path / "models") and cfg.teacher == "Qwen/Qwen3-0.6B"
    assert cfg.data.train == str(tmp_path / "t.jsonl")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.method = cfg.method
    changed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=1.0))
    assert changed.train.lr == 1.0 and cfg.train.lr != 1.0


def test_override_paths_resolve_against_the_current_folder_and_the_files_against_its_folder(tmp_path, monkeypatch):
    """`student=./smol` on the command line means ./smol where the user stands; the file's own relative
    paths stay relative to the file (a user's report: the override resolved to cfg/smol)."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "here").mkdir()
    path = write_config(tmp_path / "cfg", {"student": "./s", "teachers": {"small": "./t"}, "data": {"train": "train.jsonl"}})
    monkeypatch.chdir(tmp_path / "here")
    cfg = load_config(str(path), ["student=./smol", "data.heldout=held.jsonl", "teachers.big=../big"])
    assert cfg.student == str(tmp_path / "here" / "smol") and cfg.data.heldout == str(tmp_path / "here" / "held.jsonl")
    assert cfg.data.train == str(tmp_path / "cfg" / "train.jsonl")
    assert cfg.teachers == {"small": str(tmp_path / "cfg" / "t"), "big": str(tmp_path / "big")}


REWARD_MODULE = "def mentions_answer(response, row):\n    return float(str(row['answer']) in response)\n"
TOOL_MODULE = "def echo(arguments, row):\n    return arguments['text']\n"


@pytest.mark.parametrize("where", ["config folder", "current folder"])
def test_a_custom_reward_beside_the_config_or_in_the_current_folder_imports(tmp_path, tiny_assets, monkeypatch, where):
    """A user's `reward: <module>:<function>` imports from the config file's folder and from the folder
    init runs in, without PYTHONPATH (which used to be the only way); init records both folders in the
    run, and a process that opens the run later (a stage, another worker) imports the reward, and a tool
    named the same way, from there."""
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # what init adds does not leak into other tests
    module = f"user_reward_{where.split()[0]}"  # a module name no other test imports
    (tmp_path / "cfg").mkdir()
    (tmp_path / "work").mkdir()
    folder = (tmp_path / "cfg") if where == "config folder" else (tmp_path / "work")
    folder.joinpath(f"{module}.py").write_text(REWARD_MODULE)
    folder.joinpath(f"{module}_tools.py").write_text(TOOL_MODULE)
    path = write_config(tmp_path / "cfg", tiny_config_dict(tiny_assets, reward=f"{module}:mentions_answer"))
    monkeypatch.chdir(tmp_path / "work")
    result = runner.invoke(app, ["init", str(tmp_path / "run"), "--config", str(path)])
    assert result.exit_code == 0, result.output
    recorded = yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())["plugin_dirs"]
    assert recorded == [str(tmp_path / "cfg"), str(tmp_path / "work")]
    # A fresh process knows nothing of init's import path: it opens the run and scores with the reward.
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in recorded])
    __import__("sys").modules.pop(module, None)
    from gndpo.pipeline.tasks.rewards import run_rewards
    from gndpo.stages.text.agent import ToolUse

    cfg = open_run(str(tmp_path / "run")).cfg
    rewards = run_rewards(cfg)
    assert rewards[f"{module}:mentions_answer"]("it is 42", {"answer": 42}) == 1.0
    tools = ToolUse.from_config(dataclasses.replace(cfg.rollout, tools=[f"say={module}_tools:echo"])).tools
    assert tools["say"]({"text": "hi"}, {}) == "hi"


def test_lr_falls_within_each_round_and_decays_across_rounds():
    """train.lr_round_decay d with cosine: round r's step i of n trains at p*m + p*(1-m)(1+cos(pi i/(n-1)))/2
    with peak p = lr * d**r and floor ratio m; constant keeps p through the round."""
    tc = config_from_dict({"train": {"lr": 1e-3, "lr_schedule": "cosine", "lr_min_ratio": 0.2,
                            "lr_round_decay": 0.5}}).train
    for r, peak in [(0, 1e-3), (1, 5e-4), (2, 2.5e-4)]:
        want = [peak * 0.2 + peak * 0.8 * (1 + math.cos(math.pi * i / 4)) / 2 for i in range(5)]
        assert [round_lr(tc, r, i, 5) for i in range(5)] == pytest.approx(want, rel=1e-12)
    constant = dataclasses.replace(tc, lr_schedule="constant")
    assert [round_lr(constant, 2, i, 5) for i in range(5)] == pytest.approx([2.5e-4] * 5, rel=1e-12)
    with pytest.raises(GndpoError, match="lr_round_decay"):
        config_from_dict({"train": {"lr_round_decay": 0}})
