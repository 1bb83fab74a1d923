"""Small tables that are not shards: user prompt sources (files, folders and dataset ids), the run's
prompt tables and `gndpo eval`'s result files.

A prompt source is read by :func:`read_table_url`, the one place that knows files and formats:

* a ``.jsonl`` (or ``.json`` lines), ``.parquet`` or ``.csv`` file, a local path or any fsspec URL;
* a folder (local, or an fsspec URL) of Parquet shards, every ``*.parquet`` in it in sorted order;
* a folder written by the ``datasets`` package's ``save_to_disk`` (a ``Dataset``: ``state.json`` and
  ``data-*.arrow``; a ``DatasetDict``: ``dataset_dict.json`` and a folder per split), read with pyarrow
  alone;
* a dataset id in the ``datasets`` cache: ``hf:ORG/NAME``, ``hf:ORG/NAME/CONFIG`` or
  ``hf://datasets/ORG/NAME`` (``load_dataset``, which respects ``HF_DATASETS_OFFLINE`` and
  ``HF_HUB_OFFLINE``; needs the ``datasets`` package).

A folder or a dataset id picks a split with ``@SPLIT`` at the end (``data/gsm8k@test``,
``hf:openai/gsm8k/main@train``); it may be left out where there is only one. A folder of Parquet
shards has splits where its files are named as the Hub names them, ``SPLIT-00000-of-00002.parquet``.
"""

from __future__ import annotations

import io
import json
import posixpath
import re
import uuid

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from gndpo.errors import GndpoError, first_line, whole_message
from gndpo.storage.runfs import RunFS

READERS = {
    ".jsonl": lambda f: pl.read_ndjson(f),
    ".json": lambda f: pl.read_ndjson(f),
    ".parquet": lambda f: pl.read_parquet(f),
    ".csv": lambda f: pl.read_csv(f),
}
# A Parquet shard named as the Hub names them: the split, then the shard's number and count.
SHARD_NAME = re.compile(r"^(?P<split>[\w.]+?)-\d{5}-of-\d{5}")
HF_DATASETS = "hf://datasets/"


def read_table_url(url: str) -> pl.DataFrame:
    """Read a prompt source into polars: a jsonl / parquet / csv file, a folder of Parquet shards, a
    ``save_to_disk`` folder or a dataset id, each with an optional ``@SPLIT`` (the module's docstring
    lists the forms); any problem is a one-line GndpoError."""
    if is_dataset_id(url):
        return read_dataset_id(url)
    suffix = next((s for s in READERS if url.endswith(s)), None)
    if suffix is not None:
        return read_file(url, suffix)
    fs, path = source_fs(url)
    source, split = url, ""
    if not fs.isdir(path) and split_mark(url)[1]:  # a folder named with @SPLIT (unless its own name has an @)
        source, split = split_mark(url)
        fs, path = source_fs(source)
    if fs.isdir(path):
        return read_folder(fs, path.rstrip("/"), source.rstrip("/"), split)
    if fs.exists(path):
        what = f"a split (@{split}) names part of a folder or a dataset id, not of a file" if split else \
            "unsupported prompts file type (use .jsonl, .parquet or .csv, a folder, or a dataset id hf:ORG/NAME)"
        raise GndpoError(f"{what}: {url}")
    hint = " (a dataset id is written hf:ORG/NAME)" if re.fullmatch(r"[\w.-]+/[\w.-]+(@\w+)?", url) else ""
    raise GndpoError(f"prompts file or folder not found: {source}{hint}")


def split_mark(url: str) -> tuple[str, str]:
    """``url`` without its ``@SPLIT`` ending, and the split ("" where it names none)."""
    head, mark, tail = url.rpartition("@")
    return (head, tail) if mark and head and tail and "/" not in tail else (url, "")


def source_fs(url: str):
    """The fsspec filesystem and path of ``url``; a one-line error for an unknown protocol."""
    try:
        return fsspec.core.url_to_fs(url)
    except Exception as exc:
        raise GndpoError(f"cannot open prompts source {url}: {first_line(exc)}") from None


def read_file(url: str, suffix: str) -> pl.DataFrame:
    """One jsonl / parquet / csv file, by its suffix."""
    try:
        with fsspec.open(url, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise GndpoError(f"prompts file not found: {url}") from None
    except Exception as exc:
        raise GndpoError(f"cannot open prompts file {url}: {first_line(exc)}") from None
    try:
        return READERS[suffix](io.BytesIO(data))
    except Exception as exc:
        raise GndpoError(f"malformed prompts file {url}: {first_line(exc)}") from None


def pick_split(splits: list[str], split: str, url: str) -> str:
    """The split to read: the one named, or the only one there is."""
    if split in splits:
        return split
    if split:
        raise GndpoError(f"{url} has no split {split!r} (splits: {', '.join(splits)})")
    if len(splits) == 1:
        return splits[0]
    example = "train" if "train" in splits else splits[0]
    raise GndpoError(f"{url} has several splits ({', '.join(splits)}): name one, e.g. {url}@{example}")


def read_folder(fs, path: str, url: str, split: str) -> pl.DataFrame:
    """A ``save_to_disk`` folder (a DatasetDict's split, or a Dataset), else a folder of Parquet shards."""
    names = {posixpath.basename(p.rstrip("/")): p for p in fs.ls(path, detail=False)}
    if "dataset_dict.json" in names:
        splits = list(read_json(fs, names["dataset_dict.json"], url).get("splits") or [])
        chosen = pick_split(splits, split, url)
        return read_saved_dataset(fs, f"{path}/{chosen}", f"{url}@{chosen}", "")
    if "state.json" in names:
        return read_saved_dataset(fs, path, url, split)
    return read_parquet_folder(sorted(n for n in names if n.endswith(".parquet")), url, split)


def read_json(fs, path: str, url: str) -> dict:
    """A small JSON file of a saved dataset."""
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        raise GndpoError(f"saved dataset {url} is missing {posixpath.basename(path)}") from None
    except Exception as exc:
        raise GndpoError(f"malformed saved dataset {url}: {posixpath.basename(path)}: {first_line(exc)}") from None


def read_saved_dataset(fs, path: str, url: str, split: str) -> pl.DataFrame:
    """A ``Dataset.save_to_disk`` folder: its ``data-*.arrow`` files (Arrow IPC streams) in the order
    its ``state.json`` lists them."""
    state = read_json(fs, f"{path}/state.json", url)
    if split and split != state.get("_split"):
        raise GndpoError(f"{url} is one saved Dataset, not a DatasetDict: it has no split {split!r} "
                         f"(splits: {state.get('_split') or 'none'}); leave @{split} out")
    files = [f"{path}/{entry['filename']}" for entry in state.get("_data_files") or []] or sorted(fs.glob(f"{path}/data-*.arrow"))
    if not files:
        raise GndpoError(f"saved dataset {url} has no data-*.arrow files")
    tables = []
    for name in files:
        try:
            with fs.open(name, "rb") as f:
                tables.append(pa.ipc.open_stream(f).read_all())
        except FileNotFoundError:
            raise GndpoError(f"saved dataset {url} is missing {posixpath.basename(name)}") from None
        except Exception as exc:
            raise GndpoError(f"malformed saved dataset {url}: {posixpath.basename(name)}: {first_line(exc)}") from None
    return pl.from_arrow(pa.concat_tables(tables, promote_options="default"))


def read_parquet_folder(names: list[str], url: str, split: str) -> pl.DataFrame:
    """Every ``*.parquet`` in a folder, in sorted order; where all are named ``SPLIT-00000-of-00002``,
    those of one split."""
    if not names:
        raise GndpoError(f"prompts folder {url} has no .parquet files (nor a datasets save_to_disk layout)")
    matches = [SHARD_NAME.match(n) for n in names]
    if all(matches):
        chosen = pick_split(sorted({m["split"] for m in matches}), split, url)
        names = [n for n, m in zip(names, matches) if m["split"] == chosen]
    elif split:
        raise GndpoError(f"{url} has no split {split!r}: its Parquet files are not named SPLIT-00000-of-00001.parquet "
                         f"(leave @{split} out, or name the split's own folder)")
    return pl.concat([read_file(f"{url}/{n}", ".parquet") for n in names], how="diagonal_relaxed")


def is_dataset_id(url: str) -> bool:
    """``hf:ORG/NAME[/CONFIG]``, or ``hf://datasets/ORG/NAME`` (deeper ``hf://`` paths, and one ending
    in ``/``, are files and folders read through fsspec)."""
    if url.startswith("hf:") and not url.startswith("hf://"):
        return True
    repo = split_mark(url[len(HF_DATASETS):])[0]
    return url.startswith(HF_DATASETS) and repo.count("/") == 1 and not repo.endswith("/")


def read_dataset_id(url: str) -> pl.DataFrame:
    """A split of a dataset in the ``datasets`` cache (or the Hub, where not offline), by ``load_dataset``."""
    spec, split = split_mark(url[len(HF_DATASETS):] if url.startswith(HF_DATASETS) else url[len("hf:"):])
    parts = spec.split("/")
    if not 1 <= len(parts) <= 3 or not all(parts):
        raise GndpoError(f"dataset id {url}: write hf:ORG/NAME, hf:ORG/NAME/CONFIG or hf://datasets/ORG/NAME, each with an optional @SPLIT")
    try:
        import datasets
    except ImportError:
        raise GndpoError("reading a dataset id needs the datasets package: pip install 'gndpo[datasets]'") from None
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()  # not the cache's notes ("using the latest cached version")
    try:
        loaded = datasets.load_dataset("/".join(parts[:2]), parts[2] if len(parts) == 3 else None)
    except Exception as exc:
        raise GndpoError(f"cannot read dataset {url}: {whole_message(exc)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    chosen = pick_split(list(loaded), split, split_mark(url)[0])
    return pl.from_arrow(loaded[chosen].with_format("arrow")[:])


def write_prompt_table(run: RunFS, rel: str, table: pl.DataFrame) -> None:
    """Write a prompt table as Parquet at ``rel`` in the run (exclusive create: never overwritten)."""
    buf = io.BytesIO()
    table.write_parquet(buf)
    run.write_new(rel, buf.getvalue())


def read_prompt_table(run: RunFS, rel: str) -> list[dict]:
    """A prompt table of the run, one dict per row."""
    return pl.read_parquet(io.BytesIO(run.read_bytes(rel))).to_dicts()


def write_file(url: str, data: bytes) -> None:
    """Write ``data`` to ``url`` (any fsspec URL) under a temporary name and move it into place, so a
    crash never leaves a half-written file under the final name."""
    fs, path = fsspec.core.url_to_fs(url)
    if fs.isdir(path):
        raise GndpoError(f"{url} is a folder; give a file path")
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    except BaseException as exc:
        if fs.exists(tmp):  # never leave the temporary file behind
            fs.rm(tmp)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, url) from exc  # the path the user gave, not the temporary one
        raise


def write_results(folder: str, table: pa.Table, summary: dict) -> dict:
    """``folder/per_prompt.parquet`` and ``folder/summary.json`` (any fsspec URL), each moved into place
    only when complete."""
    folder = folder.rstrip("/")
    paths = {"per_prompt": f"{folder}/per_prompt.parquet", "summary": f"{folder}/summary.json"}
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    write_file(paths["per_prompt"], buf.getvalue())
    write_file(paths["summary"], json.dumps(summary, indent=1).encode())
    return paths


FRAME_FORMATS = ("table", "csv", "json", "parquet")


def encode_frame(df: pl.DataFrame, fmt: str) -> bytes:
    """``df`` as the bytes of an aligned text table (every row and column, no shape line), a csv, a json
    (an array of row objects) or a parquet file."""
    if fmt == "table":
        # For reading: no dtype row, floats to 4 decimals (csv, json and parquet keep every digit).
        with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=60, tbl_hide_dataframe_shape=True,
                       tbl_hide_column_data_types=True, float_precision=4):
            return (str(df) + "\n").encode()
    if fmt == "csv":
        nested = [name for name, dtype in df.schema.items() if dtype.is_nested()]
        if nested:
            raise GndpoError(
                f"csv cannot hold the nested columns {', '.join(nested)}: select scalar columns (or unnest them), "
                "or use --format json or parquet"
            )
        return df.write_csv().encode()
    if fmt == "json":
        return df.write_json().encode()
    if fmt == "parquet":
        buf = io.BytesIO()
        df.write_parquet(buf, compression="zstd")
        return buf.getvalue()
    raise GndpoError(f"unknown format {fmt!r} (use one of {', '.join(FRAME_FORMATS)})")
