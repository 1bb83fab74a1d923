"""score.backend: server against vLLM's OpenAI-compatible server on loopback (toy models, fp32).

Three real servers start once for the module: the toy teacher, the toy student served under the
teacher's name (other weights), and a model with another tokenizer under the teacher's name. The
teacher's second replica (the pool) is a process forwarding to its server: one vLLM start fewer, and
the pool sees two replicas of the same weights, as it would. The rounds scored through them equal the
HF backend's rows within float32's rounding of a forward (tests/conftest.py's model_logprob_tol); a
replica killed mid-score costs retries, not rows; each way a server can be the wrong teacher, fail,
hang or want a key is one line, with nothing written. A forwarding stub in front of a real server
stands in for the error, hang and key shapes."""

from __future__ import annotations

import json
import logging
import time

import pytest

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models import teacher_server
from gndpo.stages.teachers.registry import check_teacher_backend
from tests.conftest import assert_one_line_error, assert_teacher_columns_agree, committed_rows, invoke, invoke_ok, model_logprob_tol, run_stages
from tests.teacher_servers import ForwardingReplica, StubServer, self_signed_certificate, start_servers

pytestmark = pytest.mark.slow
NAME = "toy-teacher"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_assets, other_tokenizer_teacher):
    """{"a", "b": the teacher's replicas (b a process forwarding to a), "student": other weights,
    "tokenizer": another tokenizer}, all serving under the teacher's name."""
    folder = tmp_path_factory.mktemp("teacher-servers")
    specs = {"a": tiny_assets / "teacher", "student": tiny_assets / "student", "tokenizer": other_tokenizer_teacher}
    started = dict(zip(specs, start_servers([(model, NAME) for model in specs.values()], folder)))
    started["b"] = ForwardingReplica(started["a"].url)
    yield started
    for server in started.values():
        server.kill()


def server_settings(*urls: str, **more) -> list[str]:
    """Overrides that score through ``urls``."""
    return ["score.backend=server", f"score.servers={json.dumps(list(urls))}", f"score.server_model={NAME}",
            *(f"score.{k}={v}" for k, v in more.items())]


def fork(rolled_out, path, *settings: str) -> str:
    invoke_ok("fork", rolled_out, path, "--from-round", "0", *settings)
    return str(path)


@pytest.fixture(scope="module")
def rounds(rolled_out, servers, tmp_path_factory):
    """For GNDPO and for reverse KL on the teacher's top-16: ({"hf", "server"}: the run folder), each
    round scored, normalized and trained, the server's through the two replicas."""
    folder = tmp_path_factory.mktemp("server-rounds")
    runs = {}
    for method in ("gndpo", "reverse_kl"):
        settings = [f"method.name={method}", "score.teacher_topk=16"]
        runs[method] = {"hf": fork(rolled_out, folder / f"{method}-hf", *settings),
                        "server": fork(rolled_out, folder / f"{method}-server", *settings, *server_settings(servers["a"].url, servers["b"].url))}
        for run in runs[method].values():
            run_stages(run, "score", "normalize", "train")
    return runs


@pytest.mark.parametrize("method", ["gndpo", "reverse_kl"])
def test_a_round_through_two_replicas_equals_the_hf_backends(rounds, method, tiny_assets):
    hf, server = (committed_rows(rounds[method][k], "score") for k in ("hf", "server"))
    assert len(hf) == len(server) == 32
    assert_teacher_columns_agree(hf, server, model_logprob_tol(tiny_assets / "teacher"), topk=method == "reverse_kl")
    train = open_run(rounds[method]["server"]).records(0, "train").require_manifest().metrics
    reference = open_run(rounds[method]["hf"]).records(0, "train").require_manifest().metrics
    assert train["optimizer_steps"] == reference["optimizer_steps"] == 2
    assert train["loss_mean"] == pytest.approx(reference["loss_mean"], rel=1e-3, abs=1e-5)


CONTEXT_SET = "teacher_context.messages=[{role: user, content: '{answer}={prompt}'}]"


def setups(assets, other_tokenizer_teacher, servers) -> dict[str, tuple[list[str], list[str]]]:
    """{case: (settings of both forks, what the server fork adds)} for what the in-process backends do
    beyond one teacher: routed and mixed teachers, a teacher of another tokenizer, self-distillation."""
    teachers = f"teachers={{a: {assets / 'teacher'}, b: {assets / 'student'}}}"
    by_teacher = [f"score.servers={{a: [{servers['a'].url}], b: [{servers['student'].url}]}}", f"score.server_model={{a: {NAME}, b: {NAME}}}"]
    return {
        "routed": (["teacher=", teachers, "method.name=reverse_kl", "score.teacher_topk=8"], ["score.backend=server", *by_teacher]),
        "mixed": (["teacher=", teachers, "score.teacher_mix=mean", "method.name=gndpo"], ["score.backend=server", *by_teacher]),
        "cross_tokenizer": ([f"teacher={other_tokenizer_teacher}", "score.cross_tokenizer=true", "method.name=reverse_kl", "score.teacher_topk=8"],
                            server_settings(servers["tokenizer"].url)),
        "self_distillation": (["teacher=self", CONTEXT_SET, "method.name=reverse_kl", "score.teacher_topk=8"], server_settings(servers["student"].url)),
    }


@pytest.fixture(scope="module")
def other_rounds(rolled_out, servers, tiny_assets, other_tokenizer_teacher, tmp_path_factory):
    """{case: {"hf", "server": the run folder}} of :func:`setups`, round 0 scored."""
    folder, runs = tmp_path_factory.mktemp("server-cases"), {}
    for case, (both, served) in setups(tiny_assets, other_tokenizer_teacher, servers).items():
        runs[case] = {"hf": fork(rolled_out, folder / f"{case}-hf", *both), "server": fork(rolled_out, folder / f"{case}-server", *both, *served)}
        for run in runs[case].values():
            run_stages(run, "score")
    return runs


@pytest.mark.parametrize("case", ["routed", "mixed", "cross_tokenizer", "self_distillation"])
def test_several_teachers_other_tokenizers_and_self_distillation_through_servers(other_rounds, case, tiny_assets, other_tokenizer_teacher):
    """Each as the HF backend scores it, within float32's rounding of any of the models' forwards, each row recording the same teacher (a or b,
    mean(a,b), the other-tokenizer teacher, self/frozen)."""
    hf, server = (committed_rows(other_rounds[case][k], "score") for k in ("hf", "server"))
    assert len(hf) == len(server) == 32
    assert [r["teacher"] for r in hf] == [r["teacher"] for r in server]
    if case == "routed":
        assert {r["teacher"] for r in server} == {"a", "b"}
    tol = model_logprob_tol(tiny_assets / "teacher", tiny_assets / "student", other_tokenizer_teacher)
    assert_teacher_columns_agree(hf, server, tol, topk=case != "mixed")


def test_a_served_teacher_by_hub_id_needs_no_weights_here(rolled_out, rounds, servers, tiny_assets, tmp_path, monkeypatch):
    """A teacher named by hub id whose cached snapshot holds its config and tokenizer only (as init
    downloads a served teacher: its weights stay on the hub and the servers): init accepts it, records
    the resolution without weights, and score reads the snapshot for the tokenizer."""
    import shutil

    import huggingface_hub.constants as hub_constants

    from tests.test_hub_models import add_snapshot

    files = tmp_path / "teacher-files"
    shutil.copytree(tiny_assets / "teacher", files, ignore=shutil.ignore_patterns("*.safetensors"))
    hub = tmp_path / "hf" / "hub"
    add_snapshot(hub, "acme/served-teacher", files, "served", ("main",))
    for name, value in (("HF_HOME", str(tmp_path / "hf")), ("HF_HUB_CACHE", str(hub)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    run = fork(rolled_out, tmp_path / "run", "teacher=acme/served-teacher", "method.name=gndpo", "score.teacher_topk=16",
               *server_settings(servers["a"].url))
    assert open_run(run).hub_models["acme/served-teacher"]["weights"] is False
    run_stages(run, "score")
    scored = committed_rows(run, "score")
    assert {r["teacher"] for r in scored} == {"acme/served-teacher"}
    assert_teacher_columns_agree(committed_rows(rounds["gndpo"]["server"], "score"), scored, model_logprob_tol(tiny_assets / "teacher"), topk=False)


def test_each_wrong_teacher_is_one_line_and_nothing_is_written(rolled_out, servers, tmp_path):
    """The name the server reports, its tokenizer, and the weights of a replica (the probe sequence
    scored apart from the first server's) are each checked when a run is created."""
    cases = [
        (server_settings(servers["a"].url)[:2] + ["score.server_model=Org/other-teacher"], f"serves {NAME}, not Org/other-teacher"),
        (server_settings(servers["a"].url, servers["tokenizer"].url), "tokenizes a probe text differently"),
        (server_settings(servers["a"].url, servers["student"].url), "scores the probe sequence"),
        (server_settings(servers["a"].url)[:2], "name the model the servers of the teacher"),  # a local folder, no server_model
    ]
    for i, (settings, fragment) in enumerate(cases):
        result = invoke("fork", rolled_out, tmp_path / f"fork{i}", "--from-round", "0", *settings)
        assert_one_line_error(result, fragment)
        assert not (tmp_path / f"fork{i}").exists()


@pytest.fixture
def stub(servers):
    stub = StubServer(servers["a"].url)
    yield stub
    stub.close()


def test_a_failing_or_hanging_server_is_one_line_naming_it(rolled_out, stub, tmp_path):
    for mode, fragment in (("error", "HTTP 500"), ("hang", "ReadTimeout")):
        stub.mode = mode
        result = invoke("fork", rolled_out, tmp_path / mode, "--from-round", "0", *server_settings(stub.url, server_timeout_s=1))
        assert_one_line_error(result, f"teacher server {stub.url}", fragment)


def test_an_https_server_is_verified_against_the_named_ca_bundle(rolled_out, servers, tmp_path):
    """A self-signed server: refused in one line against the system's certificates, accepted with its
    certificate named in score.server_ca_bundle."""
    certificate = self_signed_certificate(tmp_path)
    https = StubServer(servers["a"].url, certificate)
    try:
        assert https.url.startswith("https://")
        refused = invoke("fork", rolled_out, tmp_path / "system", "--from-round", "0", *server_settings(https.url))
        assert_one_line_error(refused, f"teacher server {https.url}: its certificate does not verify", "score.server_ca_bundle")
        fork(rolled_out, tmp_path / "bundle", *server_settings(https.url, server_ca_bundle=certificate[0]))
        assert https.requests > 0
    finally:
        https.close()


def test_when_every_server_fails_score_commits_nothing_and_the_rerun_resumes(rolled_out, rounds, stub, tmp_path, caplog, tiny_assets):
    """The servers pass the worker's checks, then fail every response: within score.server_outage_s of
    the last answer (plus at most a request's timeout) score exits with one line naming each server's
    last error, after the lines saying the server went out of the pool and the time left; no unit
    committed; the rerun scores the round as an undisturbed run did."""
    run = fork(rolled_out, tmp_path / "run", "method.name=reverse_kl", "score.teacher_topk=16",
               *server_settings(stub.url, server_outage_s=3, server_timeout_s=5))
    stub.mode = "error-scoring"
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="gndpo"):  # the terminal's level is another test's to set
        result = invoke("score", run, "--round", 0)
    took = time.monotonic() - started
    said = "\n".join(r.getMessage() for r in caplog.records)
    last = result.stderr.strip().splitlines()[-1]
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert last.startswith("error: every teacher server failed for") and f"{stub.url}: HTTP 500" in last, last
    assert f"teacher server {stub.url} failed (HTTP 500" in said and "the unit fails in" in said, said
    assert took < 3 + 5 + 15, took  # the deadline, a request's timeout, and the worker's start (engine-free: the student's forward)
    records = open_run(run).records(0, "score")
    assert records.manifest() is None and not records.done_units()
    stub.mode = "pass"
    invoke_ok("score", run, "--round", 0)
    assert_teacher_columns_agree(committed_rows(rounds["reverse_kl"]["server"], "score"), committed_rows(run, "score"),
                                 model_logprob_tol(tiny_assets / "teacher"), topk=True)


def test_a_server_key_comes_from_the_environment_and_is_written_nowhere(rolled_out, stub, tmp_path, monkeypatch):
    stub.mode, stub.key = "key", "s3cret-teacher-key"
    settings = [*server_settings(stub.url), "score.server_api_key_env=GNDPO_TEST_TEACHER_KEY"]
    monkeypatch.delenv("GNDPO_TEST_TEACHER_KEY", raising=False)
    assert_one_line_error(invoke("fork", rolled_out, tmp_path / "unset", "--from-round", "0", *settings), "GNDPO_TEST_TEACHER_KEY, which is not set")
    monkeypatch.setenv("GNDPO_TEST_TEACHER_KEY", "wrong")
    assert_one_line_error(invoke("fork", rolled_out, tmp_path / "wrong", "--from-round", "0", *settings), f"teacher server {stub.url} refused", "401")
    monkeypatch.setenv("GNDPO_TEST_TEACHER_KEY", stub.key)
    run = fork(rolled_out, tmp_path / "run", *settings)
    run_stages(run, "score", "normalize", "train")
    assert committed_rows(run, "score")
    leaked = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and stub.key.encode() in p.read_bytes()]
    assert not leaked, leaked


@pytest.mark.parametrize("data, fragment", [
    ({"method": {"name": "eopd"}}, "score.backend server gives the teacher's sampled-token and top-k log-probs only"),
    ({"method": {"name": "gndpo", "tip": {"enabled": True}}}, "the full-vocabulary KL"),
    ({"teachers": {"a": "p", "b": "q"}, "score": {"teacher_mix": "mean", "servers": {"a": ["http://x"], "b": ["http://y"]}},
      "method": {"name": "forward_kl"}}, "mixes sampled-token log-probs only"),
    ({"teachers": {"a": "p", "b": "q"}}, "must map each teacher"),
    ({"score": {"servers": []}}, "needs the teacher's servers as a list of URLs"),
    ({"score": {"servers": ["localhost:8000"]}}, "is not a URL"),
    ({"teacher": "self", "self_teacher": {"weights": "live"}}, "serves fixed weights"),
])
def test_what_servers_cannot_give_is_refused_in_one_line(data, fragment):
    data = {**data, "score": {"backend": "server", "servers": ["http://127.0.0.1:9"], **data.get("score", {})}}
    with pytest.raises(GndpoError, match=fragment):
        check_teacher_backend(config_from_dict(data))


def test_server_settings_outside_the_server_backend_are_refused():
    with pytest.raises(GndpoError, match="are for score.backend server, not hf"):
        config_from_dict({"score": {"servers": ["http://127.0.0.1:9"]}})


def test_a_server_redeployed_with_other_weights_is_refused_at_the_next_worker_start(rolled_out, servers, tmp_path, caplog):
    """The run records the served teacher's answers to the probe when it is created (and checks them
    against the teacher's weights here, which it has). A lone server behind the same URL that now
    serves other weights (the stub forwarding to the student's server) is refused by the next score
    worker in one line naming it and the gap; one serving the same weights (another replica) is accepted."""
    stub = StubServer(servers["a"].url)
    try:
        with caplog.at_level(logging.INFO, logger="gndpo"):
            invoke_ok("fork", rolled_out, tmp_path / "run", "--from-round", "0", "method.name=reverse_kl", "score.teacher_topk=16",
                      *server_settings(stub.url))
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "its servers score the probe sequence" in said and "from its weights in" in said, said
        run = str(tmp_path / "run")
        assert [len(probe) for probe in open_run(run).served_probes.values()] == [4 * 23]  # 4 probe sequences of 24 tokens
        stub.upstream = servers["student"].url
        refused = invoke("score", run, "--round", 0)
        last = refused.stderr.strip().splitlines()[-1]  # after the stage's progress line
        assert refused.exit_code != 0 and "Traceback" not in refused.output, refused.output
        assert last.startswith(f"error: teacher server {stub.url} scores the probe sequence") and "apart from the teacher its servers " \
            "served when the run was created (score.server_tolerance 0.03)" in last, last
        assert not open_run(run).records(0, "score").done_units()
        stub.upstream = servers["b"].url
        invoke_ok("score", run, "--round", 0)
        # A fork that keeps the teacher keeps the record: its servers are held to the parent's teacher.
        stub.upstream = servers["student"].url
        assert_one_line_error(invoke("fork", run, tmp_path / "fork", "--from-round", "0", "train.lr=1e-4"),
                              "apart from the teacher its servers served when the run was created")
    finally:
        stub.close()


# Last: it kills a replica the tests above use.
def test_a_replica_killed_mid_score_costs_retries_not_rows(rolled_out, rounds, servers, tmp_path, monkeypatch, tiny_assets):
    """SIGKILL of replica b once it has scored three responses: its requests in flight fail, the pool
    takes it out and retries them on a, and the round's rows equal the undisturbed run's."""
    run = fork(rolled_out, tmp_path / "run", "method.name=reverse_kl", "score.teacher_topk=16",
               *server_settings(servers["a"].url, servers["b"].url, server_in_flight=2))
    send, answered = teacher_server.ServerPool._send, []

    def send_then_kill(self, server, path, payload):
        answer = send(self, server, path, payload)
        # A response's request asks for the top-k (the checks' probe for the sampled token only).
        if server.url == servers["b"].url and payload and payload.get("prompt_logprobs"):
            answered.append(1)
            if len(answered) == 3:
                servers["b"].kill()
        return answer

    monkeypatch.setattr(teacher_server.ServerPool, "_send", send_then_kill)
    run_stages(run, "score")
    assert servers["b"].process.poll() is not None and len(answered) >= 3
    assert_teacher_columns_agree(committed_rows(rounds["reverse_kl"]["server"], "score"), committed_rows(run, "score"),
                                 model_logprob_tol(tiny_assets / "teacher"), topk=True)
