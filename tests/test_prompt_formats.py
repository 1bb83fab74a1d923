"""Prompt data as teams keep it, read by ``load_prompts`` (no model, no engine): prompt-only files (null
answers, refused only where something needs them), SFT conversations whose last turn is the
assistant's, ShareGPT rows, folders of Parquet shards, ``datasets`` folders written by ``save_to_disk``
(built with pyarrow alone, and with ``datasets`` where it is installed) and dataset ids in the
``datasets`` cache (offline; only where ``datasets`` is installed). Every refusal is one line."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from gndpo.errors import GndpoError
from gndpo.pipeline.run.prompts import load_prompts, prompt_id
from gndpo.pipeline.settings.schema import DataConfig

HAS_DATASETS = importlib.util.find_spec("datasets") is not None
needs_datasets = pytest.mark.skipif(not HAS_DATASETS, reason="the datasets package is not installed (pip install 'gndpo[datasets]')")


def has_answers(table) -> bool:
    """Whether every row of a loaded prompt table has an answer (Run.has_answers, on a run's table)."""
    return "answer" in table.columns and table.height > 0 and table["answer"].null_count() == 0


def refused(call, *fragments) -> str:
    """``call()`` raises a one-line GndpoError holding every fragment; returns the message."""
    with pytest.raises(GndpoError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft_rows(n: int = 4) -> list[dict]:
    return [{"messages": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": f"{i}+1="},
                          {"role": "assistant", "content": str(i + 1)}]} for i in range(n)]


ROWS = {"prompt": [f"{i}+2=" for i in range(6)], "answer": [str(i + 2) for i in range(6)]}


# -- answers are optional -------------------------------------------------------------------------------


def test_prompt_only_file_loads_with_null_answers_and_is_refused_where_answers_are_needed(tmp_path):
    url = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}+1="} for i in range(5)])
    table = load_prompts(url)
    assert table.height == 5 and table["answer"].dtype == pl.Utf8 and table["answer"].null_count() == 5
    assert not has_answers(table)
    assert table["prompt_id"].to_list() == [prompt_id(f"{i}+1=") for i in range(5)]
    refused(lambda: load_prompts(url, answers_for="method.name grpo"),
            f"method.name grpo needs answers: prompts file {url} has no 'answer' column (columns: prompt)")
    # A dotted key whose struct column is absent is a file without answers too.
    assert load_prompts(url, DataConfig(answer_key="reward_model.ground_truth"))["answer"].null_count() == 5


def test_answer_column_with_a_missing_value_is_refused_naming_the_row(tmp_path):
    rows = [{"prompt": f"{i}+1=", **({"answer": str(i + 1)} if i != 2 else {})} for i in range(5)]
    url = write_jsonl(tmp_path / "p.jsonl", rows)
    refused(lambda: load_prompts(url), "first row 3", "missing 'answer'")
    refused(lambda: load_prompts(url, answers_for="reward exact_match"), "reward exact_match needs answers", "first row 3")
    full = load_prompts(write_jsonl(tmp_path / "full.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]))
    assert has_answers(full)


def test_no_prompt_column_names_the_columns_there_are(tmp_path):
    url = write_jsonl(tmp_path / "p.jsonl", [{"question": "1+1=", "answer": "2"}])
    refused(lambda: load_prompts(url), "no 'prompt' column", "'messages'", "'conversations'", "columns: question, answer")


# -- chat data ------------------------------------------------------------------------------------------


def test_sft_messages_give_the_reference_and_the_prompt_before_the_reply(tmp_path):
    url = write_jsonl(tmp_path / "sft.jsonl", sft_rows())
    table = load_prompts(url, answers_for="method.name grpo")
    assert table["answer"].to_list() == ["1", "2", "3", "4"] and has_answers(table)
    first = table.row(0, named=True)
    stored = json.loads(first["messages"])
    assert stored == [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "0+1="}]
    assert first["prompt"] == "0+1=" and first["prompt_id"] == prompt_id(first["messages"])
    # The same prompts without the reply: the same ids (the id is the stored prompt's, not the reply's).
    prompt_only = [{"messages": r["messages"][:-1]} for r in sft_rows()]
    again = load_prompts(write_jsonl(tmp_path / "prompts.jsonl", prompt_only))
    assert again["prompt_id"].to_list() == table["prompt_id"].to_list() == load_prompts(url)["prompt_id"].to_list()
    assert again["answer"].null_count() == 4
    refused(lambda: load_prompts(str(tmp_path / "prompts.jsonl"), answers_for="method.name grpo"),
            "method.name grpo needs answers", "has no 'answer' column (columns: messages)")


def test_an_answer_column_wins_over_the_reply_and_the_reply_fills_its_gaps(tmp_path):
    rows = [{**r, "answer": None if i == 1 else f"a{i}"} for i, r in enumerate(sft_rows())]
    table = load_prompts(write_jsonl(tmp_path / "sft.jsonl", rows))
    assert table["answer"].to_list() == ["a0", "2", "a2", "a3"]
    assert all(json.loads(m)[-1]["role"] == "user" for m in table["messages"])


def test_mixed_rows_without_an_answer_column(tmp_path):
    rows = sft_rows(3) + [{"messages": [{"role": "user", "content": "9+1="}]}]
    url = write_jsonl(tmp_path / "mixed.jsonl", rows)
    assert load_prompts(url)["answer"].to_list() == ["1", "2", "3", None]
    refused(lambda: load_prompts(url, answers_for="method.reward_beta > 0"), "method.reward_beta > 0 needs answers", "first row 4")


def sharegpt_rows(n: int = 4) -> list[dict]:
    return [{"conversations": [{"from": "system", "value": "Answer with a number."}, {"from": "human", "value": f"{i}+1="},
                               {"from": "gpt", "value": str(i + 1)}]} for i in range(n)]


def test_sharegpt_rows_read_as_messages(tmp_path):
    table = load_prompts(write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt_rows()))
    sft = load_prompts(write_jsonl(tmp_path / "sft.jsonl", sft_rows()))
    assert table.select("prompt_id", "prompt", "messages", "answer").equals(sft.select("prompt_id", "prompt", "messages", "answer"))
    # user / assistant / tool in `from` too; another column name by data.conversations_key.
    rows = [{"dialog": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "a"}, {"from": "human", "value": "2+2="}]}]
    other = load_prompts(write_jsonl(tmp_path / "other.jsonl", rows), DataConfig(conversations_key="dialog"))
    assert [t["role"] for t in json.loads(other["messages"][0])] == ["user", "assistant", "user"] and other["answer"][0] is None


def test_sharegpt_refusals_name_the_row(tmp_path):
    rows = sharegpt_rows(3)
    rows[1]["conversations"][1]["from"] = "narrator"
    url = write_jsonl(tmp_path / "bad.jsonl", rows)
    refused(lambda: load_prompts(url), f"prompts file {url}, row 2: turn 1 has unknown 'from' 'narrator'", "human, user, gpt")
    no_user = write_jsonl(tmp_path / "no_user.jsonl", [{"conversations": [{"from": "system", "value": "s"}, {"from": "gpt", "value": "x"}]}])
    refused(lambda: load_prompts(no_user), "row 1", "no user turn")


# -- sources beyond one file ----------------------------------------------------------------------------


def test_a_folder_of_parquet_shards(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    frame = pl.DataFrame(ROWS)
    frame[3:].write_parquet(folder / "part-1.parquet")
    frame[:3].write_parquet(folder / "part-0.parquet")
    (folder / "README.md").write_text("not a shard")
    for url in (str(folder), f"{folder}/"):
        assert load_prompts(url)["prompt"].to_list() == ROWS["prompt"]  # sorted by name: part-0 first
    refused(lambda: load_prompts(f"{folder}@train"), "no split 'train'", "SPLIT-00000-of-00001.parquet")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(lambda: load_prompts(str(empty)), f"prompts folder {empty} has no .parquet files")
    refused(lambda: load_prompts(str(tmp_path / "absent")), f"prompts file or folder not found: {tmp_path / 'absent'}")
    refused(lambda: load_prompts(str(folder / "part-0.parquet") + "@train"), "a split (@train) names part of a folder or a dataset id, not of a file")


def test_hub_named_shards_have_splits(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    frame = pl.DataFrame(ROWS)
    frame[:2].write_parquet(folder / "train-00000-of-00002.parquet")
    frame[2:4].write_parquet(folder / "train-00001-of-00002.parquet")
    frame[4:].write_parquet(folder / "test-00000-of-00001.parquet")
    assert load_prompts(f"{folder}@train")["prompt"].to_list() == ROWS["prompt"][:4]
    assert load_prompts(f"{folder}@test")["prompt"].to_list() == ROWS["prompt"][4:]
    refused(lambda: load_prompts(str(folder)), "has several splits (test, train)", f"{folder}@train")
    refused(lambda: load_prompts(f"{folder}@validation"), "no split 'validation' (splits: test, train)")


def write_saved_dataset(folder: Path, frame: pl.DataFrame, split: str | None, shards: int = 2) -> None:
    """``Dataset.save_to_disk``'s layout, written with pyarrow: Arrow IPC stream files and state.json."""
    folder.mkdir(parents=True)
    table, names = frame.to_arrow(), []
    step = -(-table.num_rows // shards)
    for i in range(shards):
        names.append(f"data-{i:05d}-of-{shards:05d}.arrow")
        with pa.OSFile(str(folder / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(i * step, step))
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_fingerprint": "0",
                                                   "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                                                   "_output_all_columns": False, "_split": split}))


def save_to_disk(folder: Path, splits: dict[str, pl.DataFrame] | None, frame: pl.DataFrame | None, how: str) -> None:
    """A Dataset (``frame``) or a DatasetDict (``splits``) saved as ``datasets`` saves them."""
    if how == "datasets":
        import datasets

        def build(f: pl.DataFrame):
            return datasets.Dataset.from_dict(f.to_dict(as_series=False))

        saved = build(frame) if splits is None else datasets.DatasetDict({k: build(v) for k, v in splits.items()})
        saved.save_to_disk(str(folder), num_shards=2 if splits is None else None)
        return
    if splits is None:
        write_saved_dataset(folder, frame, None)
        return
    for name, part in splits.items():
        write_saved_dataset(folder / name, part, name, shards=1)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))


@pytest.mark.parametrize("how", ["pyarrow", pytest.param("datasets", marks=needs_datasets)])
def test_a_save_to_disk_folder(tmp_path, how):
    frame = pl.DataFrame(ROWS)
    one = tmp_path / "one"
    save_to_disk(one, None, frame, how)
    assert load_prompts(str(one))["prompt"].to_list() == ROWS["prompt"]
    refused(lambda: load_prompts(f"{one}@test"), f"{one} is one saved Dataset, not a DatasetDict", "no split 'test'")
    several = tmp_path / "dict"
    save_to_disk(several, {"train": frame[:4], "test": frame[4:]}, None, how)
    assert load_prompts(f"{several}@test")["prompt"].to_list() == ROWS["prompt"][4:]
    assert load_prompts(f"{several}@train")["answer"].to_list() == ROWS["answer"][:4]
    assert load_prompts(f"{several / 'train'}")["prompt"].to_list() == ROWS["prompt"][:4]  # a split's own folder
    refused(lambda: load_prompts(f"{several}@validation"), f"{several} has no split 'validation' (splits: train, test)")
    refused(lambda: load_prompts(str(several)), "has several splits (train, test): name one", f"{several}@train")
    (several / "test" / "state.json").unlink()
    refused(lambda: load_prompts(f"{several}@test"), "missing state.json")


def test_save_to_disk_conversations_without_answers(tmp_path):
    """The arrow layout carries nested columns: ShareGPT turns as structs, prompt-only."""
    frame = pl.DataFrame([{"conversations": r["conversations"][:-1]} for r in sharegpt_rows()])
    write_saved_dataset(tmp_path / "chat", frame, "train", shards=1)
    table = load_prompts(str(tmp_path / "chat"))
    assert table["prompt"].to_list() == [f"{i}+1=" for i in range(4)] and not has_answers(table)


def test_a_dataset_id_without_the_datasets_package(monkeypatch):
    if HAS_DATASETS:
        import sys

        monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as where it is not installed
    refused(lambda: load_prompts("hf:acme/toy@train"), "reading a dataset id needs the datasets package: pip install 'gndpo[datasets]'")
    refused(lambda: load_prompts("hf:"), "write hf:ORG/NAME")


@needs_datasets
def test_a_dataset_id_in_the_datasets_cache_offline(tmp_path, monkeypatch):
    """The cache as ``load_dataset`` leaves it after a download (CACHE/acme___toy/CONFIG/VERSION/HASH/,
    its arrow files and dataset_info.json), built here from local Parquet files, read offline."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    frame = pl.DataFrame(ROWS)
    frame[:4].write_parquet(tmp_path / "train.parquet")
    frame[4:].write_parquet(tmp_path / "test.parquet")
    build = Parquet(cache_dir=str(tmp_path / "build"), dataset_name="toy", hash="0123abcd",
                    data_files={"train": str(tmp_path / "train.parquet"), "test": str(tmp_path / "test.parquet")})
    build.download_and_prepare()
    cache = tmp_path / "cache"
    (cache / "acme___toy").mkdir(parents=True)
    (config_dir,) = [p for p in (tmp_path / "build" / "toy").iterdir() if p.is_dir()]
    shutil.move(str(config_dir), str(cache / "acme___toy" / "default"))  # the hub's config name
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    assert load_prompts("hf:acme/toy@test")["prompt"].to_list() == ROWS["prompt"][4:]
    assert load_prompts("hf://datasets/acme/toy@train")["answer"].to_list() == ROWS["answer"][:4]
    assert load_prompts("hf:acme/toy/default@test")["prompt"].to_list() == ROWS["prompt"][4:]
    refused(lambda: load_prompts("hf:acme/toy"), "hf:acme/toy has several splits (train, test)", "hf:acme/toy@train")
    refused(lambda: load_prompts("hf:acme/toy@validation"), "hf:acme/toy has no split 'validation' (splits: train, test)")
    refused(lambda: load_prompts("hf:acme/absent@train"), "cannot read dataset hf:acme/absent@train")
    refused(lambda: load_prompts("hf:acme/toy/other@train"), "cannot read dataset hf:acme/toy/other@train", "other")
