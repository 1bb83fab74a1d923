"""A round's rows rewritten in the order train takes them: one local Parquet file per optimizer step.

Train shuffles a round's responses into mini-batches, so the rows of one step lie scattered over every
shard of the round. Reading a step from the shards would read the whole round at every step; holding
the round in memory would make train's memory grow with the round. Instead train reads the round once,
shard by shard, and appends each shard's rows of step i to step i's file here; step i is then one
sequential read of one file. Appended rows wait in memory up to ``buffer_bytes`` in all, then every
step's waiting rows become one row group of its file (a row group per shard and step would cost more
to write and read than the rows themselves on a round of many small steps). A round whose rows never
pass ``buffer_bytes`` stays in memory and writes no file. The files are a private scratch copy in the
machine's temporary folder (``TMPDIR``), never part of the run, and go when the object is closed or
collected.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

BUFFER_BYTES = 64 << 20  # rows waiting in memory before they go to the files


class StepFiles:
    """``steps`` append-only local Parquet files, written while a round is read and read back one step
    at a time. Not thread-safe while writing; reads (after :meth:`seal`) may come from any thread."""

    def __init__(self, steps: int, buffer_bytes: int | None = None, prefix: str = "gndpo-steps-"):
        self._folder = tempfile.TemporaryDirectory(prefix=prefix)
        self._writers: dict[int, pq.ParquetWriter] = {}
        self._waiting: dict[int, list[pa.Table]] = {}
        self._waiting_bytes = 0
        self._schema: pa.Schema | None = None
        self.steps, self.buffer_bytes = steps, BUFFER_BYTES if buffer_bytes is None else buffer_bytes

    def path(self, step: int) -> Path:
        return Path(self._folder.name) / f"step-{step:06d}.parquet"

    def append(self, step: int, table: pa.Table) -> None:
        """Add ``table``'s rows to step ``step``'s file (every table must have the same schema)."""
        if not table.num_rows:
            return
        self._schema = self._schema or table.schema
        self._waiting.setdefault(step, []).append(table)
        self._waiting_bytes += table.nbytes
        if self._waiting_bytes > self.buffer_bytes:
            self._flush()

    def _flush(self) -> None:
        for step, tables in sorted(self._waiting.items()):
            if step not in self._writers:
                # zstd at a low level: the files are read once, from local disk.
                self._writers[step] = pq.ParquetWriter(self.path(step), self._schema, compression="zstd", compression_level=1)
            self._writers[step].write_table(pa.concat_tables(tables))
        self._waiting.clear()
        self._waiting_bytes = 0

    def seal(self) -> None:
        """Finish every file (or, where nothing was written yet, keep the rows in memory); no more appends."""
        if self._writers:
            self._flush()
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def read(self, step: int) -> pa.Table | None:
        """Step ``step``'s rows as appended (None where no row was appended to it)."""
        if step in self._waiting:
            return pa.concat_tables(self._waiting[step])
        path = self.path(step)
        return pq.read_table(path) if path.exists() else None

    def bytes_on_disk(self) -> int:
        return sum(f.stat().st_size for f in Path(self._folder.name).glob("*.parquet"))

    def close(self) -> None:
        """Remove the files and the rows kept in memory."""
        self.seal()
        self._waiting.clear()
        self._folder.cleanup()
