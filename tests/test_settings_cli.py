"""One way to set things: ``key=value`` after the arguments on every command that takes settings (the old
``--set``, ``--rl-set``, ``-n`` and ``eval --n`` still work, each with one notice line), ``--rounds``
alike everywhere, ``gndpo config show`` (a whole config that inits back to the same fingerprint),
``gndpo config keys`` (every key from the schema), ``gndpo --version`` and the LICENSE.

The commands that would train (demo, compare, recipe, run, eval) run here with their application
function replaced by one that records what it was given: these tests are about the command line."""

import dataclasses
import sys
import types
import typing
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from gndpo.pipeline.config.keys import config_keys
from gndpo.pipeline.config.load import config_to_yaml, load_config
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import Config
from tests.conftest import assert_one_line_error, invoke, invoke_ok, tiny_config_dict

ROOT = Path(__file__).resolve().parents[1]


def notices(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("notice: ")]


# -- gndpo config keys ----------------------------------------------------------------------------------


def leaf_keys(cls, prefix="") -> list[str]:
    """Every leaf key of a config dataclass, walked here independently of config_keys."""
    hints = typing.get_type_hints(cls, include_extras=True)
    keys = []
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        typ = typing.get_args(typ)[0] if typing.get_origin(typ) is typing.Annotated else typ
        keys += leaf_keys(typ, f"{prefix}{f.name}.") if dataclasses.is_dataclass(typ) else [f"{prefix}{f.name}"]
    return keys


def test_config_keys_lists_every_leaf_with_its_type_default_bounds_choices_and_description():
    docs = {d.key: d for d in config_keys()}
    assert list(docs) == leaf_keys(Config)
    assert [k for k, d in docs.items() if not d.description.strip()] == []
    defaults = Config()
    assert docs["rollout.max_tokens"].type == "int" and docs["rollout.max_tokens"].default == str(defaults.rollout.max_tokens)
    assert docs["rollout.max_tokens"].allows == ">= 1"
    assert docs["rollout.top_p"].allows == "> 0 and <= 1" and docs["train.zero_stage"].allows == ">= 0 and <= 3"
    assert docs["rollout.truncated"].allows == "one of keep, mask, drop" and docs["rollout.truncated"].default == '"keep"'
    assert docs["method.policy_loss"].allows.startswith("one of '', gspo")
    assert docs["logging.backends"].allows == "each one of tensorboard, wandb" and docs["logging.backends"].type == "list[str]"
    assert docs["model.lora.target_modules"].default == '["all-linear"]'
    assert docs["score.engine.dtype"].description == docs["engine.dtype"].description != ""
    # The block of comments above a field and the one at the end of its line both count.
    assert docs["method.topk_form"].description.startswith("Top-k divergences:")
    assert docs["rollout.n"].description == "samples per prompt"


def test_config_keys_command_filters_by_prefix_and_refuses_an_unknown_one():
    lines = invoke_ok("config", "keys", "rollout.max").stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["rollout.max_tokens", "rollout.max_turns", "rollout.max_tool_response_tokens"]
    assert ">= 1" in lines[0] and "the most tokens of a response" in lines[0]
    assert "one of keep, mask, drop" in invoke_ok("config", "keys", "rollout.truncated").stdout
    everything = invoke_ok("config", "keys").stdout.splitlines()
    assert len(everything) == len(leaf_keys(Config))
    assert_one_line_error(invoke("config", "keys", "rolout"), "no config key starts with 'rolout'", "did you mean rollout")


# -- gndpo config show ----------------------------------------------------------------------------------


def config_files(tmp_path: Path) -> list[tuple[Path, list[str]]]:
    """Configs to round-trip: the examples, and a small one with settings on the command line."""
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(tiny_config_dict(Path("/models"), reward="math")))
    return [*((p, []) for p in sorted((ROOT / "examples").glob("*.yaml"))),
            (small, ["train.lr=1e-5", "method.name=opd", "rollout.stop=[END]", "data.train=prompts/train.jsonl"])]


def test_config_show_round_trips_at_the_config_level(tmp_path):
    """load -> YAML -> load gives the same config, and the YAML holds every key with its default."""
    for path, settings in config_files(tmp_path):
        cfg = load_config(str(path), settings)
        shown = tmp_path / f"shown-{path.stem}.yaml"
        shown.write_text(config_to_yaml(cfg))
        again = load_config(str(shown))
        assert again == cfg and again.fingerprint() == cfg.fingerprint(), path
    data = yaml.safe_load(config_to_yaml(load_config(None)))
    for doc in config_keys():  # every key is in the YAML, with its default
        node = data
        for part in doc.key.split("."):
            node = node[part]
    assert data["method"]["outcome"]["rewards"] == ["exact_match"] and data["rollout"]["max_tokens"] == Config().rollout.max_tokens


def test_config_show_of_a_file_and_of_a_run_inits_back_to_the_same_fingerprint(tmp_path, tiny_config, monkeypatch):
    """`gndpo config show` of a config file with settings, and of the run init made of it: `gndpo init
    --config` of either output makes a run of the same fingerprint."""
    monkeypatch.chdir(tmp_path)
    first = tmp_path / "first"
    invoke_ok("init", first, "--config", tiny_config, "train.lr=1e-5", "rollout.n=3")
    fingerprint = open_run(str(first)).cfg.fingerprint()
    for i, source in enumerate([[tiny_config, "train.lr=1e-5", "rollout.n=3"], [first], [first / "run.yaml"]]):
        shown = tmp_path / f"shown{i}.yaml"
        shown.write_text(invoke_ok("config", "show", *source).stdout)
        assert yaml.safe_load(shown.read_text())["rollout"]["n"] == 3
        again = tmp_path / f"again{i}"
        invoke_ok("init", again, "--config", shown)
        assert open_run(str(again)).cfg.fingerprint() == fingerprint
    # Settings over a run's config, and the one-line refusals.
    changed = yaml.safe_load(invoke_ok("config", "show", first, "train.lr=0.5").stdout)
    assert changed["train"]["lr"] == 0.5 and changed["rollout"]["n"] == 3
    assert_one_line_error(invoke("config", "show", tmp_path / "nope.yaml"), "config file not found")
    assert_one_line_error(invoke("config", "show", tmp_path / "nothing-here"), "not a gndpo run")
    assert_one_line_error(invoke("config", "show", tiny_config, "rollout.nn=2"), "unknown config key rollout.nn", "did you mean rollout.n")
    assert_one_line_error(invoke("config", "show", tiny_config, first), "takes one CONFIG_OR_RUN")


# -- key=value and --rounds on every command, the old spellings with a notice ------------------------------


@pytest.fixture
def calls(monkeypatch):
    """The application functions of demo, compare, recipe, run and eval replaced by recorders: {name: kwargs}."""
    seen: dict = {}

    def recorder(name, result=None):
        def record(*args, **kwargs):
            seen[name] = {"args": args, **kwargs}
            return result() if callable(result) else result
        return record

    fakes = {
        "gndpo.apps.demo": {"run_demo": recorder("demo", [])},
        "gndpo.apps.compare": {"run_compare": recorder("compare", [])},
        "gndpo.apps.recipe": {"sparse_to_dense": recorder("stages", []), "run_recipe": recorder("recipe", [])},
        "gndpo.apps.loop": {"run_loop": recorder("run")},
        "gndpo.apps.evaluation": {"EvalOptions": recorder("eval_options"), "evaluate": recorder("eval", lambda: {"files": {"per_prompt": "p"}})},
    }
    for module, functions in fakes.items():
        monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**functions))
    monkeypatch.setattr("gndpo.cli.run.round_summary", lambda run: "summary")
    return seen


SET = "notice: --set is deprecated; write key=value after the arguments"


def test_demo_takes_key_value_after_its_folder_and_the_old_set_and_n_with_a_notice(calls):
    result = invoke_ok("demo", "out", "rollout.n=2", "method.name=opd", "--rounds", "2")
    assert calls["demo"]["args"] == ("out", 2, ["rollout.n=2", "method.name=opd"]) and notices(result) == []
    invoke_ok("demo", "rollout.n=2")
    assert calls["demo"]["args"] == ("demo-run", 3, ["rollout.n=2"])
    result = invoke_ok("demo", "out", "--set", "rollout.n=2", "-n", "2", "method.name=opd")
    assert calls["demo"]["args"] == ("out", 2, ["rollout.n=2", "method.name=opd"])
    assert notices(result) == [SET, "notice: -n is deprecated; write --rounds 2 (-n reads like rollout.n, the samples per prompt)"]
    assert_one_line_error(invoke("demo", "out", "other"), "demo takes one FOLDER")
    # A command that fails says only its error, in one line, old spellings or not.
    assert_one_line_error(invoke("demo", "--set", "rollout.n=2", "--rounds", "2", "-n", "3"), "--rounds 2 and -n 3 disagree")


def test_compare_takes_key_value_for_every_method_and_method_plus_key_value_for_one(calls):
    result = invoke_ok("compare", "opd", "gdpo+method.outcome.coef=1", "rollout.n=2", "--rounds", "1")
    assert calls["compare"]["args"] == (["opd", "gdpo+method.outcome.coef=1"], "compare-run", 1, ["rollout.n=2"]) and notices(result) == []
    result = invoke_ok("compare", "opd", "gdpo+method.outcome.coef=1", "--set", "rollout.n=2", "-n", "1")
    assert calls["compare"]["args"] == (["opd", "gdpo+method.outcome.coef=1"], "compare-run", 1, ["rollout.n=2"])
    assert notices(result)[0] == SET and notices(result)[1].startswith("notice: -n is deprecated; write --rounds 1")
    assert_one_line_error(invoke("compare", "rollout.n=2"), "compare needs at least one METHOD")


def test_recipe_takes_key_value_and_stage_plus_key_value_and_the_old_options_with_a_notice(calls, tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"student": "/models/s", "teacher": "/models/t"}))
    new = ("train.lr=1e-5", "teacher-rl+rollout.n=2", "distill+method.name=reverse_kl")
    old = ("--set", "train.lr=1e-5", "--rl-set", "rollout.n=2", "--distill-set", "method.name=reverse_kl")
    for spelling, expected in ((new, []), (old, [SET, "notice: --rl-set is deprecated; write teacher-rl+key=value after the arguments",
                                                 "notice: --distill-set is deprecated; write distill+key=value after the arguments"])):
        result = invoke_ok("recipe", "sparse-to-dense", tmp_path / "out", "--config", base, *spelling)
        base_cfg, *_, rl, distill = calls["stages"]["args"]
        assert base_cfg.train.lr == 1e-5 and rl == ["rollout.n=2"] and distill == ["method.name=reverse_kl"]
        assert sorted(notices(result)) == sorted(expected)
    assert_one_line_error(invoke("recipe", "sparse-to-dense", tmp_path / "out", "--config", base, "nope+train.lr=1"),
                          "neither key=value nor STAGE+key=value", "teacher-rl, distill")


def test_run_takes_rounds_and_the_old_n_with_a_notice(calls, tmp_path):
    assert notices(invoke_ok("run", tmp_path, "--rounds", "2")) == [] and calls["run"]["args"] == (str(tmp_path), 2)
    invoke_ok("run", tmp_path)
    assert calls["run"]["args"] == (str(tmp_path), 3)
    result = invoke_ok("run", tmp_path, "-n", "4")
    assert calls["run"]["args"] == (str(tmp_path), 4) and notices(result)[0].startswith("notice: -n is deprecated; write --rounds 4")


def test_eval_samples_is_spelled_samples_and_the_old_n_gets_a_notice(calls, tmp_path):
    assert notices(invoke_ok("eval", tmp_path, "--k", "2", "--samples", "4")) == []
    assert calls["eval_options"]["args"][:3] == (None, 2, 4)
    result = invoke_ok("eval", tmp_path, "--k", "2", "--n", "5")
    assert calls["eval_options"]["args"][:3] == (None, 2, 5)
    assert notices(result) == ["notice: --n is deprecated; write --samples 5 (--n reads like a round count)"]
    assert_one_line_error(invoke("eval", tmp_path, "--k", "4", "--samples", "2"), "--samples (2) must be at least --k (4)")


# -- --version and the license ------------------------------------------------------------------------------


def test_version_prints_the_installed_packages_version():
    assert invoke_ok("--version").stdout == f"gndpo {metadata.version('gndpo')}\n"


def test_the_repository_is_apache_2_licensed():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "Copyright 2026 The gndpo authors" in text and "END OF TERMS AND CONDITIONS" in text
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
