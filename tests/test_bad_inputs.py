"""Bad input and operating mistakes, as a new user makes them: each is one line on stderr (``error: ...``,
no traceback), a non-zero exit, and nothing written, neither in the folder the command was pointed at
nor in the current folder, nor in the committed run it read.

The table grows with every bad input a user reports. A case is (id, argv, fragments of the line); argv
may name:

* ``{run}``: a run created by ``gndpo init`` (read, never written: its files are compared before and
  after);
* ``{new}``: a path that does not exist yet (a run folder to create, an output file);
* ``{cfg}``: the tiny toy config, whose every check passes; ``{cfg:NAME}``: the same with one thing
  wrong, built by ``CONFIGS[NAME]``;
* ``{file}``: an existing regular file; ``{dir}``: an existing empty folder; ``{assets}``: the toy's
  assets folder.

Each case runs in process through the real Typer app (usage errors included) with the current folder
set to an empty folder of its own.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import invoke, missing_component, tiny_config_dict


def _cfg(**sections):
    return lambda tmp, assets: tiny_config_dict(assets, **sections)


def _model_without_weights(tmp: Path, assets: Path) -> dict:
    folder = tmp / "no-weights"
    shutil.copytree(assets / "student", folder, ignore=shutil.ignore_patterns("*.safetensors"))
    return tiny_config_dict(assets, student=str(folder))


def _truncated_weights(tmp: Path, assets: Path) -> dict:
    """An interrupted copy: the student's model.safetensors cut 100 bytes short."""
    folder = tmp / "truncated"
    shutil.copytree(assets / "student", folder)
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    return tiny_config_dict(assets, student=str(folder))


def _missing_shard(tmp: Path, assets: Path) -> dict:
    """A sharded checkpoint whose index names a shard the folder lacks."""
    folder = tmp / "sharded"
    shutil.copytree(assets / "student", folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    return tiny_config_dict(assets, student=str(folder))


def _not_a_model(tmp: Path, assets: Path) -> dict:
    (tmp / "empty-model").mkdir()
    return tiny_config_dict(assets, student=str(tmp / "empty-model"))


def _prompts(lines: str, name: str = "p.jsonl"):
    def build(tmp: Path, assets: Path) -> dict:
        (tmp / name).write_text(lines)
        cfg = tiny_config_dict(assets)
        cfg["data"]["train"] = str(tmp / name)
        return cfg

    return build


def _few_prompts(tmp: Path, assets: Path) -> dict:
    rows = (assets / "train.jsonl").read_text().splitlines()[:5]
    return _prompts("\n".join(rows) + "\n")(tmp, assets)


# Configs with one thing wrong (written as YAML, so .inf, lists and nulls are what a file would hold).
CONFIGS = {
    "inf_lr": _cfg(train={"lr": float("inf")}),
    "nan_temperature": _cfg(rollout={"temperature": float("nan")}),
    "section_scalar": _cfg(rollout=0),
    "misspelled_key": _cfg(rolout={"n": 2}),
    "misspelled_method": _cfg(method={"name": "gpro"}),
    "no_weights": _model_without_weights,
    "truncated_weights": _truncated_weights,
    "missing_shard": _missing_shard,
    "not_a_model": _not_a_model,
    "few_prompts": _few_prompts,
    "prompts_csv_typo": _prompts("a,b\n1,2\n", "p.tsv"),
    "prompts_malformed": _prompts("{not json\n"),
    "prompts_no_column": _prompts('{"question": "1+1=", "answer": "2"}\n' * 20),
    "prompts_missing_answer": _prompts("".join(json.dumps({"prompt": f"{i}+1=", **({"answer": str(i + 1)} if i != 2 else {})}) + "\n" for i in range(20))),
    "prompts_image_column": _prompts("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "images": ["x.png"]}) + "\n" for i in range(20))),
    "prompts_content_parts": _prompts("".join(json.dumps({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{i}+1="}]}],
                                                          "answer": str(i + 1)}) + "\n" for i in range(20))),
    "prompt_too_long": _prompts("".join(json.dumps({"prompt": f"{i}+1=" + ("9" * 40 if i == 7 else ""), "answer": str(i + 1)}) + "\n" for i in range(20))),
    "reward_unknown": _cfg(reward="nope"),
    "teacher_missing": _cfg(teacher="/nonexistent/teacher"),
    "list_config": lambda tmp, assets: [1, 2],
}

BAD = [
    # -- creating a run ----------------------------------------------------------------------------
    ("init-empty-path", ["init", "", "-c", "{cfg}"], ["run folder path is empty"]),
    ("init-into-a-file", ["init", "{file}", "-c", "{cfg}"], ["not a folder", "{file}"]),
    ("init-inf-lr", ["init", "{new}", "-c", "{cfg:inf_lr}"], ["train.lr must be a finite number"]),
    ("init-inf-temperature", ["init", "{new}", "-c", "{cfg}", "rollout.temperature=.inf"], ["rollout.temperature must be a finite number"]),
    ("init-nan-temperature", ["init", "{new}", "-c", "{cfg:nan_temperature}"], ["rollout.temperature must be a finite number"]),
    ("init-section-as-scalar", ["init", "{new}", "-c", "{cfg}", "rollout=0"], ["config section rollout must be a mapping"]),
    ("init-section-scalar-in-file", ["init", "{new}", "-c", "{cfg:section_scalar}"], ["config section rollout must be a mapping"]),
    ("init-misspelled-key", ["init", "{new}", "-c", "{cfg:misspelled_key}"], ["unknown config key rolout", "did you mean rollout?"]),
    ("init-misspelled-override", ["init", "{new}", "-c", "{cfg}", "rollout.temprature=0.5"], ["did you mean rollout.temperature?"]),
    ("init-misspelled-method", ["init", "{new}", "-c", "{cfg:misspelled_method}"], ["got 'gpro'", "did you mean grpo?"]),
    ("init-misspelled-choice", ["init", "{new}", "-c", "{cfg}", "model.dtype=bfloat61"], ["model.dtype must be one of", "did you mean bfloat16?"]),
    ("init-model-without-weights", ["init", "{new}", "-c", "{cfg:no_weights}"], ["student: no model weights in"]),
    ("init-truncated-weights", ["init", "{new}", "-c", "{cfg:truncated_weights}"], ["student:", "model.safetensors cannot be loaded", "truncated"]),
    ("init-missing-shard", ["init", "{new}", "-c", "{cfg:missing_shard}"], ["student:", "1 missing weight file", "model-00002-of-00002"]),
    ("init-not-a-model", ["init", "{new}", "-c", "{cfg:not_a_model}"], ["not a model folder"]),
    ("init-missing-teacher", ["init", "{new}", "-c", "{cfg:teacher_missing}"], ["teacher model path does not exist"]),
    ("init-fewer-prompts-than-a-round", ["init", "{new}", "-c", "{cfg:few_prompts}"], ["data.train has 5 prompts, fewer than rollout.prompts_per_round 16"]),
    ("init-prompts-unknown-type", ["init", "{new}", "-c", "{cfg:prompts_csv_typo}"], ["unsupported prompts file type"]),
    ("init-prompts-malformed", ["init", "{new}", "-c", "{cfg:prompts_malformed}"], ["malformed prompts file"]),
    ("init-prompts-without-prompt-column", ["init", "{new}", "-c", "{cfg:prompts_no_column}"], ["prompt"]),
    ("init-prompts-missing-answer", ["init", "{new}", "-c", "{cfg:prompts_missing_answer}"], ["first row 3", "missing 'answer'"]),
    ("init-prompts-image-column", ["init", "{new}", "-c", "{cfg:prompts_image_column}"], ["image not found", "x.png"]),
    ("init-prompts-content-parts", ["init", "{new}", "-c", "{cfg:prompts_content_parts}"], ["row 1 has an image part but the file has no 'images' column"]),
    ("init-prompt-too-long", ["init", "{new}", "-c", "{cfg:prompt_too_long}"], ["longest data.train prompt (row 8, prompt_id "]),
    ("init-prompts-missing", ["init", "{new}", "-c", "{cfg}", "data.train=/nonexistent/train.jsonl"], ["prompts file not found"]),
    ("init-unknown-reward", ["init", "{new}", "-c", "{cfg:reward_unknown}"], ["unknown reward 'nope'"]),
    ("init-override-reward-typo", ["init", "{new}", "-c", "{cfg}", "reward=exact-match"], ["unknown reward 'exact-match'; did you mean exact_match?"]),
    ("init-config-missing", ["init", "{new}", "-c", "{tmp}/missing.yaml"], ["config file not found"]),
    ("init-config-not-yaml", ["init", "{new}", "-c", "{file}"], ["is not valid YAML"]),
    ("init-config-a-list", ["init", "{new}", "-c", "{cfg:list_config}"], ["must be a mapping"]),
    ("init-override-without-equals", ["init", "{new}", "-c", "{cfg}", "train.lr"], ["is not of the form key=value"]),
    ("init-override-into-a-value", ["init", "{new}", "-c", "{cfg}", "reward.x=1"], ["config key reward must be str"]),
    ("init-float-for-int", ["init", "{new}", "-c", "{cfg}", "rollout.n=1.5"], ["rollout.n must be int"]),
    ("init-bool-for-int", ["init", "{new}", "-c", "{cfg}", "rollout.n=true"], ["rollout.n must be int"]),
    ("init-word-for-float", ["init", "{new}", "-c", "{cfg}", "train.lr=fast"], ["train.lr must be float"]),
    ("init-zero-count", ["init", "{new}", "-c", "{cfg}", "rollout.n=0"], ["rollout.n must be >= 1"]),
    ("init-negative-context", ["init", "{new}", "-c", "{cfg}", "engine.max_model_len=-1"], ["engine.max_model_len must be >= 0"]),
    ("init-unknown-teacher-mix", ["init", "{new}", "-c", "{cfg}", "score.teacher_mix=avg"], ["score.teacher_mix must be one of"]),
    ("init-tropd-outlier", ["init", "{new}", "-c", "{cfg}", "method.tropd.outlier=drop"], ["method.tropd.outlier must be one of"]),
    ("init-unknown-backend", ["init", "{new}", "-c", "{cfg}", "logging.backends=[nope]"], ["logging.backends"]),
    ("init-other-config-same-folder", ["init", "{run}", "-c", "{cfg}", "train.lr=0.5"], ["was created from another config"]),
    # -- the command line ----------------------------------------------------------------------------
    ("misspelled-command", ["rollot", "{run}"], ["No such command 'rollot'", "Did you mean 'rollout'?"]),
    ("missing-argument", ["run"], ["Missing argument", "gndpo run --help"]),
    ("misspelled-option", ["run", "{run}", "--rouds", "3"], ["No such option: --rouds", "--rounds"]),
    ("negative-rounds", ["run", "{run}", "--rounds", "-2"], ["--rounds", "greater than or equal to 1"]),
    ("zero-rounds", ["run", "{run}", "--rounds", "0"], ["--rounds"]),
    ("rounds-not-a-number", ["run", "{run}", "--rounds", "many"], ["--rounds", "valid integer"]),
    ("round-not-a-number", ["rollout", "{run}", "--round", "first"], ["--round"]),
    ("unknown-log-level", ["--log-level", "loud", "status", "{run}"], ["log level must be one of"]),
    ("unknown-progress-mode", ["--progress", "fancy", "status", "{run}"], ["progress mode must be one of"]),
    ("demo-negative-rounds", ["demo", "{new}", "--rounds", "-1", "--assets", "{assets}"], ["--rounds"]),
    ("demo-bad-override", ["demo", "{new}", "--assets", "{assets}", "--set", "bad=1"], ["unknown config key bad"]),
    ("demo-override-typo", ["demo", "{new}", "--assets", "{assets}", "--set", "train.lrr=1"], ["did you mean train.lr?"]),
    ("demo-unknown-task", ["demo", "{new}", "--task", "poetry"], ["unknown demo task 'poetry'"]),
    ("demo-assets-not-toy", ["demo", "{new}", "--assets", "{dir}"], ["is not a toy assets folder"]),
    # -- stages, status and fork on the wrong folder or round -------------------------------------------
    ("stage-on-missing-run", ["rollout", "{tmp}/nothing", "--round", "0"], ["not a gndpo run"]),
    ("stage-on-a-file", ["score", "{file}", "--round", "0"], ["not a gndpo run"]),
    ("stage-out-of-order", ["normalize", "{run}", "--round", "0"], ["of round 0 is not committed"]),
    ("stage-round-ahead", ["rollout", "{run}", "--round", "3"], ["not committed"]),
    ("status-on-missing-run", ["status", "{tmp}/nothing"], ["not a gndpo run"]),
    ("fork-uncommitted-round", ["fork", "{run}", "{new}", "--from-round", "0"], ["round 0"]),
    ("fork-missing-parent", ["fork", "{tmp}/nothing", "{new}", "--from-round", "0"], ["not a gndpo run"]),
    # (fork into a file needs a parent with a committed round: tests/test_fork.py)
    ("report-on-missing-run", ["report", "{tmp}/nothing"], ["not a gndpo run"]),
    ("gc-on-missing-run", ["gc", "{tmp}/nothing"], ["not a gndpo run"]),
    ("eval-missing-model", ["eval", "{tmp}/nothing"], ["does not exist"]),
    ("compare-unknown-method", ["compare", "gndpo,nope", "--out", "{new}", "--assets", "{assets}"], ["nope"]),
    ("compare-unknown-task", ["compare", "gndpo", "--task", "poetry", "--out", "{new}"], ["unknown demo task 'poetry'"]),
    # -- convert --------------------------------------------------------------------------------------------
    ("convert-not-gguf", ["convert", "{file}", "{new}"], ["{file} is not a GGUF file"]),
    ("convert-misspelled-package", ["convert", "smolm2-135m-instruct", "{new}"], ["smolm2-135m-instruct is neither a GGUF file nor a packaged model"]),
    ("convert-into-a-full-folder", ["convert", "smollm2-135m-instruct", "{tmp}"], ["exists and is not an empty folder"]),
    # -- SQL ----------------------------------------------------------------------------------------------
    ("sql-misspelled-view", ["sql", "{run}", "SELECT * FROM rollout"], ["SQL error", 'Did you mean "rollouts"']),
    ("sql-misspelled-column", ["sql", "{run}", "SELECT rollout_idd FROM rollouts"], ["SQL error", "rollout_id"]),
    ("sql-syntax", ["sql", "{run}", "SELEC 1"], ["SQL error", "syntax error"]),
    ("sql-two-statements", ["sql", "{run}", "SELECT 1; SELECT 2"], ["exactly one SQL statement"]),
    ("sql-drop", ["sql", "{run}", "DROP VIEW rollouts"], ["only read-only queries"]),
    ("sql-copy", ["sql", "{run}", "COPY (SELECT 1) TO '{tmp}/x.csv'"], ["only read-only queries"]),
    ("sql-attach", ["sql", "{run}", "ATTACH '{tmp}/x.db'"], ["only read-only queries"]),
    ("sql-set", ["sql", "{run}", "SET threads = 1"], ["only read-only queries"]),
    ("sql-read-outside", ["sql", "{run}", "SELECT * FROM read_csv('/etc/passwd')"], ["SQL error", "--allow-files"]),
    ("sql-read-text", ["sql", "{run}", "SELECT * FROM read_text('/etc/hostname')"], ["SQL error", "--allow-files"]),
    ("sql-glob-attempts", ["sql", "{run}", "SELECT * FROM glob('{run}/rounds/*/rollout/data/**')"], ["SQL error", "--allow-files"]),
    ("sql-read-attempt-file", ["sql", "{run}", "SELECT * FROM read_parquet('{run}/run.yaml')"], ["SQL error", "--allow-files"]),
    ("sql-unknown-format", ["sql", "{run}", "SELECT 1", "--format", "xml"], ["unknown --format 'xml'"]),
    ("sql-parquet-to-stdout", ["sql", "{run}", "SELECT 1", "--format", "parquet"], ["--format parquet needs --out"]),
    ("sql-csv-nested", ["sql", "{run}", "SELECT * FROM rollouts LIMIT 1", "--format", "csv"], ["csv cannot hold the nested columns"]),
    ("sql-out-is-a-folder", ["sql", "{run}", "SELECT 1", "--out", "{dir}"], ["is a folder"]),
    ("sql-out-under-a-file", ["sql", "{run}", "SELECT 1", "--out", "{file}/x.csv", "--format", "csv"], ["{file}"]),
]


def tree(*folders: Path) -> dict:
    """Every file and folder under ``folders``: path -> size (None for a folder)."""
    return {str(p): (p.stat().st_size if p.is_file() else None) for folder in folders for p in sorted(folder.rglob("*"))}


def fill(arg: str, paths: dict, configs: dict) -> str:
    for name, path in configs.items():
        arg = arg.replace("{cfg:" + name + "}", str(path))
    return arg.format(**paths)


@pytest.fixture(scope="module")
def initialized_run(tmp_path_factory, tiny_assets) -> Path:
    folder = tmp_path_factory.mktemp("initialized")
    (folder / "cfg.yaml").write_text(yaml.safe_dump(tiny_config_dict(tiny_assets)))
    result = invoke("init", folder / "run", "-c", folder / "cfg.yaml")
    assert result.exit_code == 0, result.stderr
    return folder / "run"


@pytest.mark.parametrize("argv, fragments", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_one_line_and_nothing_written(argv, fragments, tmp_path, tiny_assets, initialized_run, monkeypatch):
    rolled_out = initialized_run
    work, cwd = tmp_path / "work", tmp_path / "cwd"
    work.mkdir()
    cwd.mkdir()
    (work / "dir").mkdir()
    (work / "file").write_text("not: [a config\n")
    paths = {"run": str(rolled_out), "new": str(work / "new"), "tmp": str(work), "file": str(work / "file"),
             "dir": str(work / "dir"), "assets": str(tiny_assets), "cfg": str(work / "cfg.yaml")}
    (work / "cfg.yaml").write_text(yaml.safe_dump(tiny_config_dict(tiny_assets)))
    configs = {}
    for name, build in CONFIGS.items():
        if any("{cfg:" + name + "}" in a for a in argv):
            (work / f"cfg-{name}.yaml").write_text(yaml.safe_dump(build(work, tiny_assets)))
            configs[name] = work / f"cfg-{name}.yaml"
    args = [fill(a, paths, configs) for a in argv]
    before = tree(work, cwd, rolled_out)
    monkeypatch.chdir(cwd)

    result = invoke(*args)

    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment.format(**paths) in lines[0], lines[0]
    assert tree(work, cwd, rolled_out) == before  # nothing written, nothing removed


def test_the_table_covers_at_least_sixty_mistakes():
    assert len(BAD) >= 60 and len({case[0] for case in BAD}) == len(BAD)


def test_outcome_rewards_default_to_the_runs_reward(tiny_assets):
    """`reward: math` with GRPO trains on math, not on the schema's exact_match (which on chat answers
    is 0 for every response, so every advantage is 0 and training changes nothing)."""
    from gndpo.pipeline.config.load import config_from_dict

    cfg = config_from_dict({**tiny_config_dict(tiny_assets), "reward": "math", "method": {"name": "grpo"}})
    assert cfg.method.outcome.rewards == ["math"]
    explicit = config_from_dict({"reward": "math", "method": {"name": "grpo", "outcome": {"rewards": ["exact_match"]}}})
    assert explicit.method.outcome.rewards == ["exact_match"]
    assert config_from_dict({}).method.outcome.rewards == ["exact_match"]


def test_sql_allow_files_opens_the_users_own_file(tmp_path, initialized_run):
    """--allow-files is the explicit way to join one's own data."""
    mine = tmp_path / "mine.csv"
    mine.write_text("rollout_id,label\nx,1\n")
    result = invoke("sql", initialized_run, f"SELECT count(*) AS n FROM read_csv('{mine}')", "--format", "json", "--allow-files")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == [{"n": 1}]


def test_a_broken_gguf_fails_convert_in_one_line_and_leaves_no_folder(tmp_path):
    """A file with GGUF's magic bytes but nothing readable after them (an interrupted download): gguf's
    reader fails, convert says so in one line, and OUT is not left behind (it used to stay, empty)."""
    if importlib.util.find_spec("gguf") is None:
        missing_component("the real-models packages (gguf) are not installed (make real-models)")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(12))
    result = invoke("convert", broken, tmp_path / "out")
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "is not a readable GGUF file" in lines[0], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf"]
