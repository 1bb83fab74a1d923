"""``rollout.backend: hf``: the student's own module samples (gndpo/stages/samplers/hf.py).

Checked against references written out here, on the toy student in float32: every stored log-prob is
the full forward's log-softmax at the sampled token (so score and train recompute the number rollout
stored), greedy decoding is the step-by-step argmax of full forwards, the processed distribution is
re-derived from its definition, a response depends on its request alone (not on the batch around it),
and the stops end a response where a request says. Then the backend in a run: a crashed rollout
resumes to the same rows, bit for bit; the demo's task learns over 3 rounds.
"""

import json
import signal
import typing

import numpy as np
import pytest
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import build_config
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import DataConfig, RolloutConfig
from gndpo.stages.models.loading import load_causal_lm, load_tokenizer
from gndpo.stages.models.sampling import SamplingRequest
from gndpo.stages.samplers.hf import HFSampler, draw, processed_logits
from gndpo.stages.samplers.registry import ROLLOUT_BACKENDS, check_rollout_backend
from gndpo.stages.text.chat import render_prompt
from tests.conftest import (
    committed_rows,
    gndpo_killed,
    invoke_ok,
    logprob_tol,
    model_logprob_tol,
    model_logprobs,
    response_log_softmax,
    run_stages,
    tiny_config_dict,
    write_config,
)


@pytest.fixture(scope="module")
def student(tiny_assets):
    """(the toy student in float32 on the CPU, its tokenizer, eight rendered prompts, cut to several
    lengths so that rows of one batch are padded)."""
    path = str(tiny_assets / "student")
    tok = load_tokenizer(path)
    rows = [json.loads(line) for line in (tiny_assets / "train.jsonl").read_text().splitlines()[:8]]
    prompts = [list(render_prompt(tok, r, DataConfig()).token_ids) for r in rows]
    prompts = [p[: len(p) - i % 4] for i, p in enumerate(prompts)]
    return load_causal_lm(path, device=torch.device("cpu"), dtype=torch.float32).eval(), tok, prompts


def test_stored_logprobs_are_the_full_forwards_log_softmax_at_the_sampled_token(student):
    """Left-padded batches (3 rows each, so 8 prompts make three), keys and values cached between steps:
    each stored log-prob equals one full forward of prompt + response, within the float32 rounding of
    two forwards (:func:`logprob_tol`), whatever the temperature and top-k/top-p the token was drawn by."""
    model, tok, prompts = student
    sampler = HFSampler(model, tok, batch=3)
    for settings in ({"temperature": 1.0}, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}):
        gens = sampler.generate(prompts, [SamplingRequest(seed=100 + i, max_tokens=10, **settings) for i in range(len(prompts))])
        for prompt, g in zip(prompts, gens):
            assert g.prompt_ids == prompt and len(g.token_ids) == len(g.logprobs) > 0
            np.testing.assert_allclose(g.logprobs, model_logprobs(model, prompt, g.token_ids), **logprob_tol(model, prompt, g.token_ids))


def test_greedy_is_the_argmax_of_full_forwards_and_stops_at_the_end_token(student):
    """Temperature 0: each token is the largest of one full forward over everything before it; the
    response ends after the model's end token (finish "stop") or at max_tokens ("length")."""
    model, tok, prompts = student
    gens = HFSampler(model, tok, batch=4).generate(prompts, [SamplingRequest(seed=0, max_tokens=8, temperature=0.0)] * len(prompts))
    for prompt, g in zip(prompts, gens):
        want = []
        while len(want) < 8 and (not want or want[-1] != tok.eos_token_id):
            want.append(int(response_log_softmax(model, prompt, want + [0])[-1].argmax()))
        assert g.token_ids == want
        assert g.finish_reason == ("stop" if want[-1] == tok.eos_token_id else "length")


def test_a_response_depends_on_its_request_alone(student):
    """The same requests in another order and other batches give the same responses; another seed, others."""
    model, tok, prompts = student
    requests = [SamplingRequest(seed=7 * i, max_tokens=10) for i in range(len(prompts))]
    together = HFSampler(model, tok, batch=8).generate(prompts, requests)
    order = list(reversed(range(len(prompts))))
    apart = HFSampler(model, tok, batch=3).generate([prompts[i] for i in order], [requests[i] for i in order])
    assert [g.token_ids for g in together] == [apart[order.index(i)].token_ids for i in range(len(prompts))]
    reseeded = HFSampler(model, tok, batch=8).generate(prompts, [SamplingRequest(seed=7 * i + 1, max_tokens=10) for i in range(len(prompts))])
    assert [g.token_ids for g in reseeded] != [g.token_ids for g in together]


def test_stop_tokens_and_strings_end_a_response_where_the_request_says(student):
    """A stop token ends the response after it (its id the stop reason); a stop string with the token
    that completes it (the string the reason); a banned token is never drawn."""
    model, tok, prompts = student
    sampler = HFSampler(model, tok, batch=8)
    free = sampler.generate(prompts, [SamplingRequest(seed=i, max_tokens=8) for i in range(len(prompts))])
    # Stop at each response's third token, named as a stop token: the same draws up to it.
    stopped = sampler.generate(prompts, [SamplingRequest(seed=i, max_tokens=8, stop_token_ids=(g.token_ids[2],))
                                         for i, g in enumerate(free) if len(g.token_ids) > 2] or pytest.fail("short responses"))
    for g, s in zip([g for g in free if len(g.token_ids) > 2], stopped):
        end = g.token_ids.index(g.token_ids[2]) + 1
        assert s.token_ids == g.token_ids[:end] and (s.finish_reason, s.stop_reason) == ("stop", g.token_ids[2])
    # A stop string: the text of the second token.
    g = next(g for g in free if len(g.token_ids) > 2 and tok.decode(g.token_ids[1:2]).strip())
    i = free.index(g)
    text = tok.decode(g.token_ids[1:2])
    s = sampler.generate([prompts[i]], [SamplingRequest(seed=i, max_tokens=8, stop=(text,))])[0]
    assert s.stop_reason == text and s.finish_reason == "stop" and text in tok.decode(s.token_ids)
    assert s.token_ids == g.token_ids[: len(s.token_ids)] and text not in tok.decode(s.token_ids[:-1])
    # The token the free responses drew most, banned: it never comes back.
    drawn = [t for g in free for t in g.token_ids]
    common = max(set(drawn), key=drawn.count)
    banned = sampler.generate(prompts, [SamplingRequest(seed=i, max_tokens=8, banned={common: -1e4}) for i in range(len(prompts))])
    assert drawn.count(common) > 1 and common not in {t for g in banned for t in g.token_ids}


def test_the_processed_distribution_is_the_one_defined(student):
    """processed_logits against a re-derivation in float64 on a random vocabulary: the bias, then the
    temperature, then the k largest, then the smallest set of the largest whose mass reaches p."""
    generator = torch.Generator().manual_seed(0)
    raw = torch.log_softmax(torch.randn(50, generator=generator, dtype=torch.float64) * 2, -1)
    request = SamplingRequest(seed=0, max_tokens=1, temperature=0.8, top_k=20, top_p=0.7, banned={int(raw.argmax()): -1e4})
    got = processed_logits(raw, request)
    z = raw.numpy().copy()
    z[int(raw.argmax())] -= 1e4
    z = z / 0.8
    z[z < np.sort(z)[-20]] = -np.inf
    ranked = np.argsort(-z, kind="stable")
    p = np.exp(z[ranked] - np.logaddexp.reduce(z[ranked]))
    keep = ranked[: int(np.searchsorted(np.cumsum(p), 0.7) + 1)]
    want = np.full_like(z, -np.inf)
    want[keep] = z[keep]
    np.testing.assert_array_equal(np.isinf(got.numpy()), np.isinf(want))
    np.testing.assert_allclose(got.numpy()[keep], want[keep], rtol=1e-15)
    assert processed_logits(raw, SamplingRequest(seed=0, max_tokens=1, temperature=0.0)).equal(raw)


def test_draws_follow_the_processed_distribution():
    """4,000 rows, each with its own seeded generator, drawn at once from the same processed distribution
    (top-k 12 of 30 at temperature 0.9): each token's count within 5 standard deviations of its binomial
    expectation, and no token outside the top-k ever drawn; at temperature 0 every row takes the largest."""
    generator = torch.Generator().manual_seed(1)
    raw = torch.log_softmax(torch.randn(30, generator=generator) * 1.5, -1)
    request = SamplingRequest(seed=0, max_tokens=1, temperature=0.9, top_k=12)
    rows = 4000
    counts = np.bincount(draw(raw.expand(rows, -1), [request] * rows, [torch.Generator().manual_seed(i) for i in range(rows)]), minlength=30)
    z = raw.double().numpy() / 0.9
    kept = np.argsort(-z)[:12]
    p = np.zeros(30)
    p[kept] = np.exp(z[kept] - np.logaddexp.reduce(z[kept]))
    assert counts[p == 0].sum() == 0
    assert np.all(np.abs(counts - rows * p) <= 5 * np.sqrt(rows * p * (1 - p)) + 1), (counts, rows * p)
    greedy = SamplingRequest(seed=0, max_tokens=1, temperature=0.0)
    assert draw(raw.expand(3, -1), [greedy] * 3, [torch.Generator()] * 3) == [int(raw.argmax())] * 3


def test_the_backends_are_the_schemas_choices_and_init_refuses_what_hf_cannot_do(tiny_assets):
    """Every rollout.backend the config accepts has a backend, and no other; hf refuses pictures in one line."""
    assert set(ROLLOUT_BACKENDS) == set(typing.get_args(typing.get_type_hints(RolloutConfig)["backend"]))
    cfg = build_config(tiny_config_dict(tiny_assets, rollout={"backend": "hf"}), [], tiny_assets)
    check_rollout_backend(cfg, with_images=False)
    with pytest.raises(GndpoError, match="rollout.backend hf samples text prompts only.*use rollout.backend vllm") as err:
        check_rollout_backend(cfg, with_images=True)
    assert "\n" not in str(err.value)


def test_a_rollout_killed_mid_generation_resumes_to_the_same_rows(tiny_assets, tmp_path):
    """Round 0's rollout with rollout.backend hf in 4 units plus the held-out one: one run straight
    through, one killed (SIGKILL, its own process) while generating its second unit and rerun; the
    committed rows are the same, bit for bit, and so is the held-out figure. The straight run then
    scores with the sampler's log-probs as the student's column and trains one step: its importance
    ratio is 1 within what two float32 forwards of the student differ by."""
    cfg = write_config(tmp_path, tiny_config_dict(tiny_assets, rollout={"backend": "hf", "prompts_per_unit": 4, "hf_batch": 8},
                                                  score={"student_logprobs": "engine"}, train={"optimizer_steps": 1}))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for run in (straight, killed):
        invoke_ok("init", run, "--config", cfg)
    run_stages(straight, "rollout")
    code = gndpo_killed("rollout", killed, "--round", "0", env={"GNDPO_CRASH_AT": "rollout.generate", "GNDPO_CRASH_AFTER": "1"},
                        log=tmp_path / "killed.log")
    assert code == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-2000:]
    assert open_run(str(killed)).records(0, "rollout").done_units() == {"u00000"}  # u00001 was being generated
    run_stages(killed, "rollout")
    assert committed_rows(killed) == committed_rows(straight) and len(committed_rows(straight)) == 16 * 2
    metrics = [open_run(str(r)).records(0, "rollout").manifest().metrics for r in (straight, killed)]
    assert metrics[0]["heldout_accuracy"] == metrics[1]["heldout_accuracy"] and metrics[0]["engine_dtype_bits"] == 32
    run_stages(straight, "score", "normalize", "train")
    opened = open_run(str(straight))
    assert opened.records(0, "score").manifest().metrics["student_logprobs_from_engine"] == 1
    ratio = opened.records(0, "train").manifest().metrics["ratio_mean"]
    assert ratio == pytest.approx(1.0, abs=2 * model_logprob_tol(tiny_assets / "student")["atol"])  # exp(d) - 1 ~ d for each token's d
