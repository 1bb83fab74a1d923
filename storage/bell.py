"""A run's commit bell: every commit rings it, and the processes of this machine that wait for a commit
wake at once instead of at their next look.

On a local run folder each waiting process keeps a named pipe in ``RUN/.bells/`` and blocks on it with a
timeout; a commit writes a byte to every pipe there (a pipe nobody reads any more, its process gone, is
removed). Processes on other machines, and runs on object storage, are not reached: they look again
after the timeout, which is their polling interval (``run.poll_seconds``).
"""

from __future__ import annotations

import errno
import os
import select
import time
import uuid

from gndpo.storage.runfs import RunFS

BELLS = ".bells"


class CommitBell:
    """Wait for the next commit of a run (:meth:`wait`), or wake those who do (:meth:`ring`)."""

    def __init__(self, fs: RunFS):
        self.folder = fs.path(BELLS) if fs.is_local else None
        self._pipe: str | None = None
        self._fds: tuple[int, int] | None = None

    def wait(self, seconds: float) -> None:
        """Return at the next commit on this machine, or after ``seconds``, whichever comes first."""
        if self.folder is None:
            time.sleep(seconds)
            return
        read_fd = self._listen()
        ready, _, _ = select.select([read_fd], [], [], seconds)
        if ready:
            try:
                while os.read(read_fd, 4096):  # every ring since the last wait: one wake-up
                    pass
            except BlockingIOError:
                pass

    def _listen(self) -> int:
        """This process's pipe, made on first use: read end non-blocking, and a write end of its own kept
        open so the pipe never reads as closed between rings."""
        if self._fds is None:
            os.makedirs(self.folder, exist_ok=True)
            self._pipe = os.path.join(self.folder, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.mkfifo(self._pipe)
            read_fd = os.open(self._pipe, os.O_RDONLY | os.O_NONBLOCK)
            self._fds = (read_fd, os.open(self._pipe, os.O_WRONLY | os.O_NONBLOCK))
        return self._fds[0]

    def ring(self) -> None:
        """Wake every process of this machine waiting on the run (best effort: a waiter not woken looks
        again after its timeout)."""
        if self.folder is None:
            return
        try:
            pipes = os.listdir(self.folder)
        except FileNotFoundError:
            return
        for name in pipes:
            path = os.path.join(self.folder, name)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nobody reads it: its process is gone
                    _remove(path)
                continue
            try:
                os.write(fd, b"\n")
            except BlockingIOError:  # full: rung already, the waiter has not read it yet
                pass
            finally:
                os.close(fd)

    def close(self) -> None:
        """Stop listening: the pipe is removed."""
        if self._fds is not None:
            for fd in self._fds:
                os.close(fd)
            _remove(self._pipe)
            self._fds = self._pipe = None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
