"""Score shard bytes per response token, at W's response lengths: sampled-token and top-16 schemes.

Reads the score shards a W round committed (``--run``, by default the one ``round_vs_trl.py`` leaves;
its method, reverse_kl, stores the teacher's top-16 per token) and writes each shard again through the
project's own Parquet writer (:func:`gndpo.storage.shards.to_parquet_bytes`) in four forms:

* sampled-token scheme (the top-k columns null, as GNDPO/OPD runs store them) and top-16 scheme;
* ``score.dtype`` float32 (as committed) and bfloat16 (per-token floats rounded as score rounds them).

Beside each, the same table written the way shards were written before (zstd, no byte-stream-split),
as the baseline. Bytes are divided by the response tokens the shards cover. Writes
``results/shard_bytes.json``.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, save_json  # noqa: E402

TOPK_COLUMNS = ("teacher_topk_ids", "teacher_topk_logprobs")


def rounded(table: pa.Table) -> pa.Table:
    """Every per-token float column rounded to bf16, as ``score.dtype: bfloat16`` stores it."""
    from gndpo.storage.shards import flat_values, list_column, round_to_bfloat16

    for i, field in enumerate(table.schema):
        leaf = field.type
        while pa.types.is_list(leaf) or pa.types.is_fixed_size_list(leaf):
            leaf = leaf.value_type
        if not pa.types.is_list(field.type) or leaf != pa.float32() or table.column(i).null_count == table.num_rows:
            continue
        values, offsets = flat_values(table.column(i))
        table = table.set_column(i, field, list_column(round_to_bfloat16(values.astype(np.float32)), np.diff(offsets), field.type))
    return table


def plain_zstd(table: pa.Table) -> int:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return len(buf.getvalue())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="/tmp/gndpo-bench/round_vs_trl/w/gndpo/run")
    a = ap.parse_args(argv)

    from gndpo.pipeline.run.run import open_run
    from gndpo.storage.shards import read_shards, to_parquet_bytes

    run = open_run(a.run)
    table = read_shards(run.fs, run.records(0, "score").require_manifest().files())
    tokens = int(sum(len(v) for v in table.column("teacher_logprobs").to_pylist()))
    sampled = table
    for name in TOPK_COLUMNS:
        i = sampled.schema.get_field_index(name)
        sampled = sampled.set_column(i, sampled.schema.field(i), pa.nulls(sampled.num_rows, sampled.schema.field(i).type))
    results = {"response_tokens": tokens, "rows": table.num_rows, "tokens_per_row": round(tokens / table.num_rows, 1),
               "topk": table.schema.field("teacher_topk_ids").type.value_type.list_size}
    for scheme, t in (("sampled", sampled), ("top16", table)):
        for dtype, tt in (("float32", t), ("bfloat16", rounded(t))):
            results[f"{scheme}_{dtype}"] = {
                "bytes_per_token": round(len(to_parquet_bytes(tt)) / tokens, 2),
                "baseline_bytes_per_token": round(plain_zstd(tt) / tokens, 2),  # zstd, no byte-stream-split
            }
    print(results, flush=True)
    save_json(RESULTS / "shard_bytes.json", results)
    return results


if __name__ == "__main__":
    main()
