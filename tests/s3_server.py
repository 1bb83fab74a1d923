"""moto's S3 server on loopback, for the S3 tests and bench/executor_scale.py."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

MOTO_SERVER = Path(sys.executable).with_name("moto_server")


def start_moto_server(port: int, timeout_s: float = 60) -> tuple[subprocess.Popen, str]:
    """(the process, its endpoint URL) of moto's server on ``port``, once it answers. In a process of its
    own: in the caller's, Flask's request-context proxies would sit in sys.modules, and vLLM's CPU
    start-up scans every module's attributes (vllm/triton_utils/dispatcher.py), which fails on them."""
    server = subprocess.Popen([str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=2)
            return server, endpoint
        except urllib.error.HTTPError:  # it answers: started
            return server, endpoint
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.2)
