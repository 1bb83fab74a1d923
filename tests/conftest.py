"""Shared fixtures: tiny toy assets (built once per session, offline) and configs that use them."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path


def _one_core_per_worker() -> None:
    """Under pytest-xdist (`make test` runs two workers), each worker and everything it starts (gndpo
    processes, their vLLM engines and DeepSpeed ranks) computes on a core of its own: two workers that
    each spread their threads over both cores of a 2-core machine are slower than one. Called before
    torch is imported, so that its OpenMP runtime starts with the worker's one core and thread: torch
    threads beyond the cores a process may use wait for each other (a toy build ran 15 times slower)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if not worker:
        return
    cores = sorted(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if len(cores) < 2 or workers < 2:
        return
    mine = [c for i, c in enumerate(cores) if i % workers == int(worker[2:]) % workers]
    os.sched_setaffinity(0, mine)
    threads = str(len(mine))
    os.environ.update({"GNDPO_THREADS": threads, "OMP_NUM_THREADS": threads,
                       "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine))})


_one_core_per_worker()

import numpy as np  # noqa: E402
import pytest  # noqa: E402  (after the worker's core is set: see above)
import torch  # noqa: E402
import yaml  # noqa: E402

from gndpo.storage.cache import cache_root  # noqa: E402
from tests.process_memory import pytest_runtest_logreport, pytest_runtest_makereport, pytest_terminal_summary  # noqa: E402, F401  (the bound on what a test leaves resident)

TINY = dict(digits=2, n_train_prompts=96, n_heldout=24)
# The user's cache, read before the fixtures point GNDPO_CACHE at a temporary folder: what is
# deterministic and slow to build (the converted real models, the demo's toy as `make demo` builds it)
# is shared with the user and between test runs.
USER_CACHE = cache_root()


def shared_folder(tmp_path_factory, name: str) -> Path:
    """``name`` in the folder every pytest-xdist worker of this test run shares (the session's own
    temporary folder without xdist), so what one worker builds the others reuse."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / name


@contextlib.contextmanager
def built_once(path: Path):
    """Build ``path`` once per test run: yields True where this process must build it (then marks it
    done), False where another worker already has; workers wait for each other on a file lock."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    done = path.with_name(path.name + ".done")
    with FileLock(str(path) + ".lock"):
        must = not done.exists()
        yield must
        if must:
            done.touch()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    path = shared_folder(tmp_path_factory, "gndpo-cache")
    path.mkdir(parents=True, exist_ok=True)
    old = os.environ.get("GNDPO_CACHE")
    os.environ["GNDPO_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("GNDPO_CACHE", None)
    else:
        os.environ["GNDPO_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_assets(cache_dir) -> Path:
    """A few-step teacher and student: real HF models and tokenizer, accuracy irrelevant."""
    from gndpo.apps.demos.arithmetic import ModelSpec, ToySpec, ensure_toy_assets

    spec = ToySpec(
        **TINY,
        model=ModelSpec(layers=1, hidden=64, heads=2, max_steps=20, lr=3e-3, batch=32),
        student_max_steps=5,
    )
    with built_once(cache_dir / "tiny-assets"):
        return ensure_toy_assets(spec, log=lambda *_: None)


@pytest.fixture(scope="session")
def other_tokenizer_teacher(tmp_path_factory, tiny_assets) -> Path:
    """A model whose tokenizer has one token more than the toy student's."""
    from gndpo.apps.demos.arithmetic import ModelSpec, build_tokenizer, new_model

    path = tmp_path_factory.mktemp("other-teacher")
    tok = build_tokenizer()
    tok.add_tokens(["x"])
    new_model(ModelSpec(layers=1, hidden=64, heads=2, max_steps=0, lr=0.0), len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_config_dict(assets: Path, **sections) -> dict:
    cfg = {
        "student": str(assets / "student"),
        "teacher": str(assets / "teacher"),
        "data": {"train": str(assets / "train.jsonl"), "heldout": str(assets / "heldout.jsonl")},
        "rollout": {"prompts_per_round": 16, "n": 2, "prompts_per_unit": 8, "max_tokens": 5},
        "score": {"rows_per_chunk": 8},
        "train": {"lr": 1e-3, "optimizer_steps": 2, "micro_batch_size": 8},
        # In-process engines start in a third of the time (engine.in_process); the tests of engine
        # processes (their death, Ctrl-C, kills) set it back to False.
        "engine": {"max_model_len": 32, "in_process": True},
    }
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value) if isinstance(value, dict) else cfg.__setitem__(key, value)
    return cfg


def write_config(folder: Path, cfg: dict) -> Path:
    """``folder/config.yaml`` holding ``cfg``."""
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def tiny_config(tmp_path, tiny_assets) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tiny_assets)))
    return path


@pytest.fixture(scope="session")
def rolled_out(tmp_path_factory, tiny_assets) -> Path:
    """A run with only round 0's rollouts committed, from prompts that each name a teacher (a or b) in a
    ``teacher`` column: the parent that fork, several-teacher and score-backend tests re-score (`gndpo
    fork`), so those tests start no rollout engine of their own; built once per test run, shared by the
    xdist workers."""
    folder = shared_folder(tmp_path_factory, "rolled-out")
    with built_once(folder) as build:
        if build:
            roll_out_round_0(folder, tiny_assets)
    return folder / "run"


def roll_out_round_0(folder: Path, tiny_assets: Path) -> None:
    """``folder/run``: the toy config (held-out eval off) with a ``teacher`` column, round 0 rolled out."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (tiny_assets / "train.jsonl").read_text().splitlines()]
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps({**r, "teacher": "ab"[i % 2]}) + "\n" for i, r in enumerate(rows)))
    cfg = tiny_config_dict(tiny_assets, rollout={"eval_heldout": False})
    cfg["data"]["train"] = str(train)
    invoke_ok("init", folder / "run", "--config", write_config(folder, cfg))
    run_stages(folder / "run", "rollout")


def committed_rows(run_dir: Path, stage: str = "rollout", round_idx: int = 0) -> list[dict]:
    """Every committed row of a rollout or score stage, sorted by rollout id."""
    import pyarrow.parquet as pq

    from gndpo.pipeline.run.run import open_run

    m = open_run(str(run_dir)).records(round_idx, stage).manifest()
    return sorted((r for f in m.row_files() for r in pq.read_table(Path(run_dir) / f.path).to_pylist()), key=lambda r: r["rollout_id"])


def round_share(run, round_idx: int, rank: int = 0, world: int = 1):
    """Rank ``rank``'s share of round ``round_idx``'s rows, as its train stage reads them."""
    from gndpo.stages.train import TrainJob
    from gndpo.stages.training.batch import load_share

    return load_share(TrainJob(run, round_idx).inputs, rank, world)


EPS32 = float(np.finfo(np.float32).eps)  # 2**-23 = 1.19e-7: float32's spacing at 1.0, twice its rounding error


def float32_sum_tol(n_terms: int, magnitude: float) -> dict[str, float]:
    """``rtol`` and ``atol`` (as np.testing.assert_allclose and torch.testing.assert_close take them) for
    two float32 computations of the same numbers whose sums add in other orders (other chunks, batch
    shapes or padding, another CPU's SIMD width or BLAS blocking, an engine's kernels): ``n_terms`` the
    roundings on the longest chain of sums behind a number, ``magnitude`` the size of its terms.
    Rounded in another order, n roundings of at most EPS32/2 each add like a random walk: about
    sqrt(n) * EPS32 of the terms' size apart (Higham & Mary, SIAM J. Sci. Comput. 2019; n * EPS32 only
    if every rounding went one way). So much of each number (rtol), and of ``magnitude`` where terms
    of that size cancel to a number near zero (atol)."""
    rel = float(np.sqrt(n_terms)) * EPS32
    return {"rtol": rel, "atol": rel * magnitude}


def forward_terms(config, context: int) -> int:
    """The roundings on a logit's longest chain of sums in one forward of a decoder over ``context``
    positions: per layer its two norms and its q/k/v, output and gate/up projections (hidden terms
    each), the attention scores (head_dim) and their weighted sum over the context, the down
    projection (intermediate); then the final norm and the head (hidden) and the log-softmax's sum
    over the vocabulary. A gradient's chain runs through the same sums backwards. A vision-language
    model's image tokens come from its tower first: the patch embedding, its layers (as above, over at
    most 4 patches per context position: 2x2 patches make one token in both families here), and a
    connector over 4 patches' features."""
    cfg = getattr(config, "text_config", None) or config
    hidden = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    terms = cfg.num_hidden_layers * (5 * hidden + head_dim + context + cfg.intermediate_size) + 2 * hidden + cfg.vocab_size
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        layers, heads = getattr(vision, "num_hidden_layers", None) or vision.depth, getattr(vision, "num_attention_heads", None) or vision.num_heads
        patch = 3 * vision.patch_size**2 * getattr(vision, "temporal_patch_size", 1)
        width = vision.hidden_size
        terms += patch + layers * (5 * width + width // heads + 4 * context + vision.intermediate_size) + 2 * 4 * width
    return terms


def logprob_tol(model, prompt, response) -> dict[str, float]:
    """float32_sum_tol for a float32 model's log-probs of ``response`` after ``prompt`` computed twice:
    the chain of :func:`forward_terms`, the magnitude the largest |log-prob| over the whole vocabulary
    at those positions (the logits, bias-free heads' of both signs, and the log-sum-exp the
    log-softmax subtracts from them are no larger)."""
    model = causal_lm(model)
    logp = response_log_softmax(model, prompt, response)
    return float32_sum_tol(forward_terms(model.config, len(prompt) + len(response)), float(logp.abs().max()))


def model_logprob_tol(*models) -> dict[str, float]:
    """float32_sum_tol for log-probs of any of these Llama-like models (modules or folders; the
    language model of a vision-language one) computed twice anywhere in their context, as stored rows
    are compared: the chain of :func:`forward_terms` over max_position_embeddings, and a magnitude
    none of their log-probs, logits or log-sum-exps exceeds. A head without bias reading the RMS-normed
    state x/rms(x) (norm sqrt(hidden)) scaled by gamma gives |logit_v| <= sqrt(hidden) * ||gamma * W_v||
    =: M (Cauchy-Schwarz), so |log-sum-exp| <= M + log V and |log-prob| <= 2M + log V."""
    n_terms, size = 0, 0.0
    for model in map(causal_lm, models):
        cfg = getattr(model.config, "text_config", None) or model.config
        text = next((getattr(model.model, name) for name in ("text_model", "language_model") if hasattr(model.model, name)), model.model)
        scaled = model.get_output_embeddings().weight.detach() * text.norm.weight.detach()
        bound = float(np.sqrt(cfg.hidden_size)) * float(scaled.norm(dim=-1).max())
        n_terms = max(n_terms, forward_terms(model.config, cfg.max_position_embeddings))
        size = max(size, 2 * bound + float(np.log(cfg.vocab_size)))
    return float32_sum_tol(n_terms, size)


def assert_teacher_columns_agree(reference: list[dict], other: list[dict], tol: dict[str, float], topk: bool) -> None:
    """Two scorings of the same rollouts (score rows sorted by rollout id): the teacher's sampled-token
    log-probs within ``tol`` (rtol and atol, from :func:`model_logprob_tol`, atol the larger for the
    log-probs compared), the student's identical and, with ``topk``, the teacher's top-k log-probs
    within ``tol``, its ids identical wherever the values are not tied, and its rest mass beside the
    top-k, exp(teacher_rest_logprob), within twice atol and the rounding of a sum of k probabilities:
    top-k log-probs each within atol + rtol * |lp| <= 2 * atol move the rest by at most sum_k p_k * 2 *
    atol (engine backends compute it as 1 - sum of the top-k p, the HF backend from its whole softmax)."""
    assert [r["rollout_id"] for r in reference] == [r["rollout_id"] for r in other] and reference
    compared = 0
    for ref, got in zip(reference, other):
        np.testing.assert_allclose(got["teacher_logprobs"], ref["teacher_logprobs"], **tol)
        assert got["student_logprobs"] == ref["student_logprobs"]
        if not topk:
            continue
        k = len(ref["teacher_topk_ids"][0])
        np.testing.assert_allclose(np.exp(np.asarray(got["teacher_rest_logprob"], np.float64)),
                                   np.exp(np.asarray(ref["teacher_rest_logprob"], np.float64)), rtol=0,
                                   atol=2 * tol["atol"] + float32_sum_tol(k, 1.0)["atol"])
        for ids_r, lp_r, ids_o, lp_o in zip(ref["teacher_topk_ids"], ref["teacher_topk_logprobs"], got["teacher_topk_ids"], got["teacher_topk_logprobs"]):
            np.testing.assert_allclose(lp_o, lp_r, **tol)
            gaps = np.diff(lp_r)  # descending: a position's id is fixed when it differs from both neighbours
            # Two values each within atol + rtol * |lp| of the reference's swap places only across a smaller gap than twice that.
            tie = 2 * (tol["atol"] + tol["rtol"] * float(np.abs(lp_r).max()))
            for j in range(len(ids_r)):
                if not ((j > 0 and abs(gaps[j - 1]) < tie) or (j < len(gaps) and abs(gaps[j]) < tie)):
                    assert ids_r[j] == ids_o[j]
                    compared += 1
    assert compared > 100 or not topk


def model_logprobs(model, prompt, response):
    """log p(response_t | prompt, response_<t) of one HF model (a module, or the folder to load it
    from), written out here: the reference the stored log-probs are checked against."""
    logp = response_log_softmax(causal_lm(model), prompt, response)
    return logp[torch.arange(len(response)), torch.tensor(response)].numpy()


def causal_lm(model):
    """``model`` itself, or the HF model in the folder it names (an image-text one where its config has
    a vision tower)."""
    if not isinstance(model, (str, Path)):
        return model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = hasattr(AutoConfig.from_pretrained(str(model)), "vision_config")
    return (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(str(model))


def response_log_softmax(model, prompt, response) -> torch.Tensor:
    """[len(response), V] float64: the log-softmax rows of one forward of prompt + response that
    predict the response's tokens."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1]
    return torch.log_softmax(logits.double(), -1)


def in_ci() -> bool:
    """Whether the suite runs as CI (``CI=true``, as CI services and .ci/run set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def missing_component(reason: str):
    """A tier's component (Chromium, Slurm, the real-model packages, moto's server) is not installed or
    will not start: skip with the reason where a person runs the suite, but under ``CI=true`` fail with
    that one line, so that CI cannot pass with a whole tier gone. Structural skips (a GPU machine, not
    root) stay plain skips."""
    if in_ci():
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on loopback right now."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def gndpo_killed(*args, env: dict, log: Path, timeout=600) -> int:
    """Run a gndpo command that is expected to SIGKILL itself (``env`` sets GNDPO_CRASH_AT), in its own
    session, then kill what it started (vLLM's engine process outlives its parent, as when the machine
    under a worker dies); output goes to ``log``. Returns the command's exit code."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gndpo.cli", *map(str, args)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **env},
        )
        code = proc.wait(timeout=timeout)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return code


# The longest test files, longest first (measured with --durations on the full suite). Two xdist workers
# take a file at a time in collection order (`--no-loadscope-reorder` in the Makefile: pytest-xdist would
# otherwise order files by their number of tests); a long file that starts last runs alone while the
# other worker idles, so they start first (longest-processing-time-first scheduling). Other files keep
# their order.
LONGEST_FILES = (
    "test_real_models.py", "test_e2e.py", "test_teacher_servers.py", "test_overlap.py", "test_demo.py", "test_slurm.py", "test_lora.py", "test_resilience.py",
    "test_operations.py", "test_data_parallel.py", "test_s3.py", "test_tool_rollout.py", "test_engine_death.py", "test_state_every.py",
    "test_logprobs.py", "test_vision.py", "test_recipe.py", "test_docs_site.py", "test_logits_budget.py", "test_engine_settings.py",
    "test_hub_models.py", "test_self_distill.py", "test_method_stages.py", "test_chat.py", "test_cross_tokenizer.py", "test_fork.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort


def invoke(*args):
    """Run a gndpo command in this process through Typer's runner (no interpreter start, no vLLM or
    DeepSpeed import unless the command needs them): the way to test refusals and other quick paths.
    The real entry point in a fresh process is :func:`gndpo`."""
    from typer.testing import CliRunner

    from gndpo.cli.app import app, register

    register()
    return CliRunner().invoke(app, [str(a) for a in args])


def invoke_ok(*args):
    """:func:`invoke` of a command that must succeed (the failure shows its output)."""
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result


def run_log(run_dir) -> str:
    """The run's log files (``RUN/logs/*-run.log``, one per `gndpo run`): gndpo's info lines whatever the
    terminal was shown, so a test that ran `gndpo run` in this process reads what it logged here."""
    return "".join(p.read_text() for p in sorted(Path(run_dir, "logs").glob("*-run.log")))


def run_stages(run_dir, *stages: str, round_idx: int = 0, live=None) -> None:
    """Run ``stages`` of a round in this process, through the code a stage command runs
    (:func:`gndpo.apps.rounds.run_stage`) without starting an interpreter and importing torch,
    vLLM and DeepSpeed again: for tests of what a stage computes, not of its process. ``live``: kept
    engines and models (:class:`gndpo.stages.models.live.LiveModels`), default none kept."""
    from gndpo.apps.rounds import run_stage

    for stage in stages:
        run_stage(str(run_dir), stage, round_idx, log=lambda *_: None, live=live)


def assert_one_line_error(result, *fragments) -> str:
    """``result`` (of :func:`invoke`) failed with exactly one ``error:`` line on stderr, no traceback,
    holding every fragment; returns the line."""
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def gndpo(*args, check=True, env=None, timeout=600, script=False) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh process (vLLM and DeepSpeed own their process): ``python -m gndpo.cli``, or
    with ``script`` the installed ``gndpo`` console script itself."""
    command = [str(Path(sys.executable).with_name("gndpo"))] if script else [sys.executable, "-m", "gndpo.cli"]
    proc = subprocess.run(
        [*command, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"gndpo {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


# Files a person may want to look at after a run of the suite (not committed).
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def open_in_chromium(page: Path, screenshot: Path) -> list[str]:
    """Load ``page`` in headless Chromium, save a screenshot, and return the console messages it logged
    (a gndpo report logs none; a figure that fails to decode logs one). Skips where Chromium is absent
    (`make test` installs it), or fails under CI (:func:`missing_component`)."""
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        missing_component("chromium is not installed (make test installs Debian's package)")
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    profile = screenshot.parent / f".chromium-{os.getpid()}"
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
         "--enable-logging=stderr", "--v=0", f"--screenshot={screenshot}", "--window-size=1280,3000", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    shutil.rmtree(profile, ignore_errors=True)
    assert screenshot.exists() and screenshot.stat().st_size > 10_000, proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
