"""Models named by hub id (``org/name[@rev]``), resolved through huggingface_hub from a cache with the
hub's real layout (blobs, snapshots of symlinks, refs), offline; the refusals a hub gives (unknown id or
revision, gated) from a local HTTP server that answers as the hub's API does."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import huggingface_hub.constants as hub_constants
import pytest
import yaml

from gndpo.storage.hub import is_hub_id, split_hub_id
from tests.conftest import assert_one_line_error, gndpo, invoke, invoke_ok, run_stages, tiny_config_dict, write_config


def add_snapshot(hub: Path, repo: str, model: Path, commit_seed: str, refs: tuple[str, ...] = ()) -> str:
    """Put ``model``'s files in ``hub`` (an HF_HUB_CACHE) as commit sha1(``commit_seed``) of ``repo``, laid
    out as huggingface_hub writes it (each file a blob named by its hash, the snapshot a folder of
    relative symlinks), and point each of ``refs`` at it. Returns the commit."""
    commit = hashlib.sha1(commit_seed.encode()).hexdigest()
    root = hub / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for path in sorted(model.rglob("*")):
        if path.is_file():
            blob = hashlib.sha256(path.read_bytes()).hexdigest()
            if not (root / "blobs" / blob).exists():
                shutil.copyfile(path, root / "blobs" / blob)
            link = snapshot / path.relative_to(model)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(root / "blobs" / blob, link.parent))
    for ref in refs:
        point_ref(hub, repo, ref, commit)
    return commit


def point_ref(hub: Path, repo: str, ref: str, commit: str) -> None:
    path = hub / f"models--{repo.replace('/', '--')}" / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(commit)


@pytest.fixture
def hub_cache(tmp_path, tiny_assets, monkeypatch):
    """An offline Hugging Face cache with ``acme/toy-student`` (main: the toy student; another commit
    holding the toy teacher's weights) and ``acme/toy-teacher`` (tag v1: the toy teacher; main: the toy
    student); HF_HOME and HF_HUB_OFFLINE set here and in the processes the test starts."""
    home = tmp_path / "hf"
    hub = home / "hub"
    commits = {
        "student": add_snapshot(hub, "acme/toy-student", tiny_assets / "student", "student-a", ("main",)),
        "student_next": add_snapshot(hub, "acme/toy-student", tiny_assets / "teacher", "student-b"),
        "teacher_v1": add_snapshot(hub, "acme/toy-teacher", tiny_assets / "teacher", "teacher-v1", ("v1",)),
        "teacher_main": add_snapshot(hub, "acme/toy-teacher", tiny_assets / "student", "teacher-main", ("main",)),
    }
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_CACHE", str(hub)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    # huggingface_hub reads its environment once, on import: this process imported it already.
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return hub, commits


def hub_config(tmp_path: Path, tiny_assets: Path, **models) -> Path:
    cfg = tiny_config_dict(tiny_assets, student="acme/toy-student", teacher="acme/toy-teacher@v1",
                           rollout={"eval_heldout": False}, score={"student_logprobs": "recompute"})
    cfg.update(models)
    return write_config(tmp_path, cfg)


def test_hub_id_spelling():
    assert split_hub_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", "main")
    assert split_hub_id("Qwen/Qwen3-8B@v1.0") == ("Qwen/Qwen3-8B", "v1.0")
    assert is_hub_id("Qwen/Qwen3-8B@" + "a" * 40)
    for folder in ("/models/student", "./models/x", "~/m/x", "s3://bucket/model", "student", "a/b/c", "run:/x/y"):
        assert not is_hub_id(folder), folder


def test_existing_folder_is_not_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name")


@pytest.mark.slow
def test_hub_models_run_a_round_at_the_recorded_commit(tmp_path, tiny_assets, hub_cache):
    """init resolves both ids once (the teacher at its tag, the student at main) and records the commits;
    after refs/main moves to a commit holding other weights, a stage run in a new process (score) still
    loads the recorded commit: its forward of the student reproduces the sampler's log-probs (fp32), which
    the other commit's weights (the teacher's) would not."""
    hub, commits = hub_cache
    run_dir = tmp_path / "run"
    invoke_ok("init", run_dir, "--config", hub_config(tmp_path, tiny_assets))
    recorded = yaml.safe_load((run_dir / "run.yaml").read_text())["hub_models"]
    assert recorded == {
        "acme/toy-student": {"id": "acme/toy-student", "revision": "main", "commit": commits["student"]},
        "acme/toy-teacher@v1": {"id": "acme/toy-teacher", "revision": "v1", "commit": commits["teacher_v1"]},
    }
    run_stages(run_dir, "rollout")  # before the refs move: its process is not the point
    point_ref(hub, "acme/toy-student", "main", commits["student_next"])
    point_ref(hub, "acme/toy-teacher", "v1", commits["teacher_main"])
    gndpo("score", run_dir, "--round", 0)  # a new process after the move, reading the student and the teacher
    run_stages(run_dir, "normalize", "train")  # the round completes on the hub-id student
    score = json.loads((run_dir / "rounds/r0000/score/_MANIFEST.json").read_text())["metrics"]
    assert score["rollout_logprob_diff_max"] < 1e-3, score
    assert (run_dir / "rounds/r0000/train/_MANIFEST.json").exists()


def test_hub_refusals_offline(tmp_path, tiny_assets, hub_cache):
    hub, _ = hub_cache
    not_cached = invoke("init", tmp_path / "a", "--config", hub_config(tmp_path, tiny_assets, teacher="acme/missing"))
    assert_one_line_error(not_cached, "teacher acme/missing is not in the Hugging Face cache", "HF_HUB_OFFLINE")
    revision = invoke("init", tmp_path / "b", "--config", hub_config(tmp_path, tiny_assets, teacher="acme/toy-teacher@v7"))
    assert_one_line_error(revision, "teacher acme/toy-teacher@v7 is not in the Hugging Face cache")
    empty = tmp_path / "config-only"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    add_snapshot(hub, "acme/no-weights", empty, "no-weights", ("main",))
    no_weights = invoke("init", tmp_path / "c", "--config", hub_config(tmp_path, tiny_assets, student="acme/no-weights"))
    assert_one_line_error(no_weights, "student acme/no-weights", "has no weights")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c" / "run.yaml").exists()


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The hub API's answers to a snapshot's revision request: 404 RepoNotFound, 404 RevisionNotFound
    (acme/toy-teacher at any revision), 403 GatedRepo (acme/gated), as huggingface_hub reads them."""

    def do_GET(self):
        code, error = 404, "RepoNotFound"
        if self.path.startswith("/api/models/acme/gated/"):
            code, error = 403, "GatedRepo"
        elif self.path.startswith("/api/models/acme/toy-teacher/revision/"):
            error = "RevisionNotFound"
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps({"error": error}).encode())

    def log_message(self, *args):
        pass


def test_hub_refusals_online(tmp_path, tiny_assets, hub_cache, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    try:
        cases = {
            "acme/unknown": "no model acme/unknown on the hub",
            "acme/toy-teacher@v9": "the hub has no revision 'v9' of acme/toy-teacher",
            "acme/gated": "teacher acme/gated is a gated model",
        }
        for i, (teacher, message) in enumerate(cases.items()):
            result = invoke("init", tmp_path / f"run{i}", "--config", hub_config(tmp_path, tiny_assets, teacher=teacher))
            assert_one_line_error(result, message, "HF_TOKEN" if "gated" in teacher else "")
    finally:
        server.shutdown()
