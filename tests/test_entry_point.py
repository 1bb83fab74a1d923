"""The `gndpo` entry point's exit: the exit status, output and exit handlers a normal interpreter exit
would give, without the module teardown it skips (gndpo.cli.app.exit_without_teardown)."""

import subprocess
import sys
import textwrap

from tests.conftest import gndpo

EXITING = textwrap.dedent("""
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    from gndpo.cli.app import exit_without_teardown

    out = Path(sys.argv[1])
    atexit.register(lambda: (out / "exit-handler").write_text("ran"))
    def late_writer():
        time.sleep(0.3)
        (out / "thread").write_text("joined")
    threading.Thread(target=late_writer).start()  # not a daemon: exit waits for it
    pool = ThreadPoolExecutor(2)  # idle workers must not keep the process alive
    pool.submit(lambda: None).result()
    sys.stdout.write("buffered, no newline")
    sys.stderr.write("to stderr")
    exit_without_teardown(3)
""")


def test_exit_without_teardown_keeps_what_a_normal_exit_promises(tmp_path):
    """Non-daemon threads are joined, exit handlers run, buffered stdout and stderr reach the reader, and
    the status is the one given; an idle thread pool does not hold the exit."""
    proc = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered, no newline" and proc.stderr == "to stderr"
    assert (tmp_path / "thread").read_text() == "joined" and (tmp_path / "exit-handler").read_text() == "ran"


def test_the_commands_exit_status_and_output_survive_the_exit(tmp_path):
    """Through the real entry point: help with no command is shown once (exit 2), a user error is one
    line on stderr (exit 1), and output piped into a reader that stops early ends quietly."""
    bare = gndpo(check=False)
    assert bare.returncode == 2 and bare.stdout.count("Usage: ") == 1, bare.stdout
    missing = gndpo("status", tmp_path / "nothing", check=False)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.strip().splitlines() == [f"error: not a gndpo run (no run.yaml): {tmp_path / 'nothing'}; create it with `gndpo init`"]
    piped = subprocess.run(f"{sys.executable} -m gndpo.cli --help | head -c 10", shell=True, capture_output=True, text=True, timeout=60)
    assert len(piped.stdout) == 10 and "Traceback" not in piped.stderr, piped.stderr
