"""Loading models: a user's mistake is one line with nothing behind it; anything else a library raises
keeps its cause, which the CLI prints (with its traceback) at --log-level debug. And the one reader of
a model's vocabulary size."""

import json
import logging
import shutil

import pytest
import typer

from gndpo.cli.common import user_errors
from gndpo.errors import GndpoError
from gndpo.stages.models import loading


def without_weights(src, dest):
    dest.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    return dest


def test_a_users_mistake_is_one_line_without_a_cause(tiny_assets, tmp_path):
    (tmp_path / "empty").mkdir()
    cases = [
        (tmp_path / "nowhere", "model path does not exist"),
        (tmp_path / "empty", "not a model folder"),
        (without_weights(tiny_assets / "student", tmp_path / "student"), "no model weights in"),
    ]
    for path, message in cases:
        with pytest.raises(GndpoError, match=message) as info:
            loading.load_causal_lm(str(path))
        assert info.value.__cause__ is None and "\n" not in str(info.value)
    for path, message in cases[:2]:
        with pytest.raises(GndpoError, match=message) as info:
            loading.load_tokenizer(str(path))
        assert info.value.__cause__ is None


def test_a_library_failure_keeps_its_cause(tiny_assets, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def out_of_memory(*a, **k):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(more detail)")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", out_of_memory)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", out_of_memory)
    student = str(tiny_assets / "student")
    for load, what in ((loading.load_causal_lm, "model"), (loading.load_tokenizer, "tokenizer")):
        with pytest.raises(GndpoError) as info:
            load(student)
        assert str(info.value) == f"cannot load a {what} from {student}: CUDA out of memory. Tried to allocate 2.00 GiB (more detail)"
        assert isinstance(info.value.__cause__, RuntimeError)


@user_errors
def failing_command():
    try:
        raise MemoryError("the real failure")
    except MemoryError as exc:
        raise GndpoError("cannot load a model from /m: the real failure") from exc


def test_the_cli_shows_the_cause_only_at_debug(capsys):
    gndpo_log = logging.getLogger("gndpo")
    old = gndpo_log.level
    try:
        gndpo_log.setLevel(logging.INFO)
        with pytest.raises(typer.Exit):
            failing_command()
        assert capsys.readouterr().err == "error: cannot load a model from /m: the real failure\n"
        gndpo_log.setLevel(logging.DEBUG)
        with pytest.raises(typer.Exit):
            failing_command()
        err = capsys.readouterr().err
    finally:
        gndpo_log.setLevel(old)
    assert "Traceback" in err and "MemoryError: the real failure" in err and "direct cause" in err
    assert err.splitlines()[-1] == "error: cannot load a model from /m: the real failure"


def test_vocabulary_size_reads_the_config_once_for_everyone(tiny_assets, tmp_path):
    student = tiny_assets / "student"
    assert loading.vocabulary_size(str(student)) == json.loads((student / "config.json").read_text())["vocab_size"]
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm/config.json").write_text(json.dumps({"text_config": {"vocab_size": 99}}))
    assert loading.vocabulary_size(str(tmp_path / "vlm")) == 99
    (tmp_path / "none").mkdir()
    (tmp_path / "none/config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(GndpoError, match="names no vocab_size"):
        loading.vocabulary_size(str(tmp_path / "none"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/config.json").write_text("{")
    with pytest.raises(GndpoError, match="corrupt model config"):
        loading.vocabulary_size(str(tmp_path / "bad"))
