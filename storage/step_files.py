"""A round's rows regrouped in the order train takes them: one local Arrow IPC file of record batches,
found by optimizer step.

Train shuffles a round's responses into mini-batches, so the rows of one step lie scattered over every
shard of the round. Reading a step from the shards would read the whole round at every step; holding
the round in memory would make train's memory grow with the round. Instead train reads the round once,
shard by shard, and appends each shard's rows of step i here. Appended rows wait in memory up to
``BUFFER_BYTES`` in all; then every step's waiting rows become one record batch of the file, and the
step remembers the batch's number. Reading step i reads its batches (a few per ``BUFFER_BYTES`` of
round) and nothing else. An Arrow IPC file rather than Parquet: its footer holds 24 bytes per batch and
a batch is read by offset, where a Parquet writer keeps every row group's column statistics in memory
until it closes (gigabytes at a billion tokens, whose steps get a row group per flush).

A round whose rows never pass ``BUFFER_BYTES`` stays in memory and writes no file. The file is a
private scratch copy in the machine's temporary folder (``TMPDIR``), never part of the run, removed
when the object is closed or collected; a process killed outright leaves it there, named
``gndpo-steps-*``.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

# Rows waiting in memory before they go to the file. A flush writes a batch per step, so a round's
# batches grow as its bytes x its steps / this: at 64 MiB a billion-token round of 954 steps wrote
# 240k batches and its index took 14x the 100M round's time; at 256 MiB, a quarter of them.
BUFFER_BYTES = 256 << 20


class StepFiles:
    """Rows appended by step while a round is read, read back one step at a time. Not thread-safe
    while writing; reads (after :meth:`seal`) may come from any thread."""

    def __init__(self, buffer_bytes: int | None = None):
        self.buffer_bytes = BUFFER_BYTES if buffer_bytes is None else buffer_bytes
        self._waiting: dict[int, list[pa.Table]] = {}
        self._waiting_bytes = 0
        self._batches: dict[int, list[int]] = {}  # step -> its record batches in the file, in order
        self._written = 0
        self._folder: tempfile.TemporaryDirectory | None = None
        self._writer: ipc.RecordBatchFileWriter | None = None
        self._sink = None
        self._source = None
        self._reader: ipc.RecordBatchFileReader | None = None  # opened at the first read, kept
        self._reading = threading.Lock()  # one file position: one read at a time

    @property
    def path(self) -> Path | None:
        return Path(self._folder.name) / "steps.arrow" if self._folder else None

    def append(self, step: int, table: pa.Table) -> None:
        """Add ``table``'s rows to step ``step`` (every table must have the same schema)."""
        if not table.num_rows:
            return
        self._waiting.setdefault(step, []).append(table)
        self._waiting_bytes += table.nbytes
        if self._waiting_bytes > self.buffer_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._writer is None:
            self._folder = tempfile.TemporaryDirectory(prefix="gndpo-steps-")
            schema = next(iter(self._waiting.values()))[0].schema
            self._sink = pa.OSFile(str(self.path), "wb")
            # lz4: the file is read once, soon, from local disk; its job is fewer bytes at little CPU.
            self._writer = ipc.new_file(self._sink, schema, options=ipc.IpcWriteOptions(compression="lz4"))
        for step, tables in sorted(self._waiting.items()):
            self._writer.write_batch(pa.concat_tables(tables).combine_chunks().to_batches()[0])
            self._batches.setdefault(step, []).append(self._written)
            self._written += 1
        self._waiting.clear()
        self._waiting_bytes = 0

    def seal(self) -> None:
        """Write what waits (where the file was started) and finish it; no more appends."""
        if self._writer is not None:
            if self._waiting:
                self._flush()
            self._writer.close()
            self._sink.close()
            self._writer = None

    def read(self, step: int) -> pa.Table | None:
        """Step ``step``'s rows as appended (None where no row was appended to it)."""
        if step in self._waiting:
            return pa.concat_tables(self._waiting[step])
        if step not in self._batches:
            return None
        with self._reading:
            if self._reader is None:
                self._source = pa.OSFile(str(self.path))
                self._reader = ipc.open_file(self._source)
            return pa.Table.from_batches([self._reader.get_batch(i) for i in self._batches[step]])

    def bytes_on_disk(self) -> int:
        return self.path.stat().st_size if self.path and self.path.exists() else 0

    def close(self) -> None:
        """Remove the file and the rows kept in memory."""
        self.seal()
        self._waiting.clear()
        with self._reading:
            if self._reader is not None:
                self._source.close()
                self._reader = None
        if self._folder is not None:
            self._folder.cleanup()
