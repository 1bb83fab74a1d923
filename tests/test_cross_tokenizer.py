"""score.cross_tokenizer: a teacher whose tokenizer merges doubled digits ("11", "22", ...) scores the
character-level student's round-0 rollouts (a fork of the shared rolled-out run). The stored teacher
values are re-derived here from the teacher model and its tokenizer's own offsets: every student token
gets one, a merged pair's two digits sharing its log-ratio, and the student's EOS gets the teacher's EOS
after the same text. The mask that would leave unaligned tokens out of normalize's statistics and train's
loss is checked too."""

import json

import numpy as np
import pytest
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.run.run import open_run
from gndpo.stages.teachers.registry import check_teacher_backend
from tests.conftest import committed_rows, float32_sum_tol, forward_terms, invoke_ok, model_logprob_tol, round_share, run_stages

pytestmark = pytest.mark.slow
CLAMP = 5.0


@pytest.fixture(scope="module")
def pair_teacher(tmp_path_factory):
    """The toy tokenizer plus ten merged tokens "00".."99", and a random 1-layer Llama over it."""
    from gndpo.apps.demos.arithmetic import ModelSpec, build_tokenizer, new_model

    path = tmp_path_factory.mktemp("pair-teacher")
    tok = build_tokenizer()
    tok.add_tokens([d + d for d in "0123456789"])
    torch.manual_seed(5)
    new_model(ModelSpec(layers=1, hidden=64, heads=2, max_steps=0, lr=0.0), len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory):
    """A second teacher with a tokenizer of its own: the toy's characters plus "12", "34" and "=1"."""
    from gndpo.apps.demos.arithmetic import ModelSpec, build_tokenizer, new_model

    path = tmp_path_factory.mktemp("other-teacher")
    tok = build_tokenizer()
    tok.add_tokens(["12", "34", "=1"])
    torch.manual_seed(6)
    new_model(ModelSpec(layers=1, hidden=64, heads=2, max_steps=0, lr=0.0), len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def crossed(rolled_out, pair_teacher, tmp_path_factory):
    new = tmp_path_factory.mktemp("cross") / "run"
    invoke_ok("fork", rolled_out, new, "--from-round", "0", f"teacher={pair_teacher}", "score.cross_tokenizer=true")
    run_stages(new, "score", "normalize", "train")
    return new


def teacher_view(tok, model, prompt_text, text, eos: bool, end_ids=None):
    """The teacher's (char offsets, log-probs) of its own tokens of ``text`` after its prompt, with
    ``eos`` the log-prob of its end after them: its EOS (the toy's template closes no turn), or the
    tokens ``end_ids`` (summed); and the tolerance of another float32 forward's log-probs against
    these (the chain's rounding at the size of the log-probs over the vocabulary, tests/conftest.py)."""
    prompt = tok.apply_chat_template([{"role": "user", "content": prompt_text}], tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    end = (end_ids or [tok.eos_token_id]) if eos else []
    own = enc["input_ids"] + end
    ids = torch.tensor([p_ids + own])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    lps = [float(logp[len(p_ids) + k - 1, t]) for k, t in enumerate(own)]
    n = len(enc["input_ids"])
    tol = float32_sum_tol(forward_terms(model.config, ids.shape[1]), float(logp[len(p_ids) - 1 :].abs().max()))
    return enc["offset_mapping"], lps[:n], (sum(lps[n:]) if eos else None), tol


def test_every_student_token_gets_its_share_of_its_spans_teacher_log_ratio(crossed, rolled_out, pair_teacher):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair_teacher))
    model = AutoModelForCausalLM.from_pretrained(str(pair_teacher)).eval()
    student_tok = AutoTokenizer.from_pretrained(str(open_run(str(rolled_out)).cfg.student))
    rollouts = {r["rollout_id"]: r for r in committed_rows(rolled_out)}
    prompts = {p["prompt_id"]: p for p in open_run(str(crossed)).prompts("train")}
    split = ends = tokens = inside = 0
    for s in committed_rows(crossed, "score"):
        r = rollouts[s["rollout_id"]]
        ids = r["response_token_ids"]
        pieces = [student_tok.decode([t], skip_special_tokens=True) for t in ids]  # one character or none
        eos = ids[-1] == student_tok.eos_token_id
        offsets, lps, eos_lp, tol = teacher_view(tok, model, prompts[r["prompt_id"]]["prompt"], "".join(pieces), eos)
        student = np.asarray(s["student_logprobs"], np.float64)
        want, aligned = student.copy(), np.zeros(len(ids), int)  # special tokens inside keep their own
        token_at = [j for j, piece in enumerate(pieces) if piece]  # the student token of each character
        # The student's tokens are single characters, so each teacher token is a span of its own.
        for (start, end), lp in zip(offsets, lps):
            js = token_at[start:end]
            want[js] = student[js] + (lp - student[js].sum()) / len(js)
            aligned[js] = 1
            split += len(js) if len(js) > 1 else 0
        if eos:
            want[-1], aligned[-1] = eos_lp, 1
            ends += 1
        # The teacher's log-probs, one float32 forward against another, shared among a span's tokens
        # (no larger for it); the student's are the stored ones on both sides.
        np.testing.assert_allclose(s["teacher_logprobs"], want, **tol)
        assert list(s["aligned"]) == aligned.tolist()
        inside += int((aligned == 0).sum())
        tokens += len(ids)
    assert split > 0 and ends > 0, "some doubled digits should have been merged, some responses ended"
    metrics = open_run(str(crossed)).records(0, "score").manifest().metrics
    assert metrics["cross_tokenizer/unaligned_tokens"] == inside  # special tokens the student sampled mid-response
    assert metrics["cross_tokenizer/split_span_fraction"] == pytest.approx(split / (tokens - inside))


def test_statistics_and_loss_leave_unaligned_tokens_out(crossed, rolled_out):
    from gndpo.pipeline.run.stats import round_stats

    rollouts = {r["rollout_id"]: r for r in committed_rows(rolled_out)}
    c = []
    for s in committed_rows(crossed, "score"):
        keep = np.asarray(rollouts[s["rollout_id"]]["loss_mask"]) * np.asarray(s["aligned"]) == 1
        c.append(np.clip(np.subtract(s["teacher_logprobs"], s["student_logprobs"]), -CLAMP, CLAMP)[keep])
    c = np.concatenate(c)
    run = open_run(str(crossed))
    got = round_stats(run, 0)
    assert got["token_count"] == c.size
    assert got["c_mean"] == pytest.approx(c.mean(), abs=1e-9) and got["c_var"] == pytest.approx(c.var(ddof=1), rel=1e-9)
    scores = {s["rollout_id"]: s for s in committed_rows(crossed, "score")}
    with round_share(run, 0) as share:
        rows = share.all_rows()
    for row in rows:
        assert np.all(row.mask[np.asarray(scores[row.rollout_id]["aligned"]) == 0] == 0)
    assert run.records(0, "train").manifest() is not None


@pytest.fixture(scope="module")
def crossed_topk(rolled_out, pair_teacher, tmp_path_factory):
    """The same fork with reverse KL on the teacher's top-8, through train."""
    new = tmp_path_factory.mktemp("cross-topk") / "run"
    invoke_ok("fork", rolled_out, new, "--from-round", "0", f"teacher={pair_teacher}", "score.cross_tokenizer=true",
              "method.name=reverse_kl", "score.teacher_topk=8")
    run_stages(new, "score", "normalize", "train")
    return new


def test_the_stored_top_k_is_the_teachers_after_the_same_text_in_the_students_vocabulary(crossed_topk, rolled_out, pair_teacher):
    """Re-derived from the teacher's own forward: each span's first student token holds the teacher's
    top-8 at the span's first teacher token, a merged "dd" as a token without a student twin, other
    characters as the student's id of that character, the teacher's EOS as the student's; the second
    digit of a merged pair holds no entry; an ended response's EOS the teacher's top-8 after the text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gndpo.pipeline.methods.losses import NO_ENTRY_ID, UNMATCHED_ID

    tok = AutoTokenizer.from_pretrained(str(pair_teacher))
    model = AutoModelForCausalLM.from_pretrained(str(pair_teacher)).eval()
    student_tok = AutoTokenizer.from_pretrained(str(open_run(str(rolled_out)).cfg.student))
    student_vocab = student_tok.get_vocab()

    def twin(t: int) -> int:
        if t == tok.eos_token_id:
            return student_tok.eos_token_id
        piece = tok.convert_ids_to_tokens(t)
        return student_vocab[piece] if t not in tok.all_special_ids and piece in student_vocab else UNMATCHED_ID

    rollouts = {r["rollout_id"]: r for r in committed_rows(rolled_out)}
    prompts = {p["prompt_id"]: p for p in open_run(str(crossed_topk)).prompts("train")}
    seen = {"entry": 0, "none": 0, "unmatched": 0}
    for s in committed_rows(crossed_topk, "score"):
        r = rollouts[s["rollout_id"]]
        ids = r["response_token_ids"]
        if any(t in student_tok.all_special_ids for t in ids[:-1]):
            continue  # special tokens mid-response: the first test covers them
        text = student_tok.decode(ids, skip_special_tokens=True)
        eos = ids[-1] == student_tok.eos_token_id
        prompt = tok.apply_chat_template([{"role": "user", "content": prompts[r["prompt_id"]]["prompt"]}], tokenize=False, add_generation_prompt=True)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        own = enc["input_ids"] + ([tok.eos_token_id] if eos else [])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p_ids + own])).logits[0].double(), -1)[len(p_ids) - 1 :]
        top = logp.topk(8, -1)
        want_ids = np.full((len(ids), 8), NO_ENTRY_ID)
        want_lp = np.zeros((len(ids), 8))
        for k, (start, _) in enumerate(enc["offset_mapping"]):  # one character per student token
            want_ids[start] = [twin(int(t)) for t in top.indices[k]]
            want_lp[start] = top.values[k].numpy()
        if eos:
            want_ids[-1] = [twin(int(t)) for t in top.indices[len(own) - 1]]
            want_lp[-1] = top.values[len(own) - 1].numpy()
        got_ids = np.asarray(s["teacher_topk_ids"])
        assert got_ids.tolist() == want_ids.tolist()
        entries = want_ids[:, 0] != NO_ENTRY_ID
        # Two float32 forwards of the teacher: within the chain's rounding at the log-probs' size.
        tol = float32_sum_tol(forward_terms(model.config, len(p_ids) + len(own)), float(logp.abs().max()))
        np.testing.assert_allclose(np.asarray(s["teacher_topk_logprobs"])[entries], want_lp[entries], **tol)
        seen["entry"] += int(entries.sum())
        seen["none"] += int((~entries).sum())
        seen["unmatched"] += int((got_ids == UNMATCHED_ID).sum())
    assert min(seen.values()) > 0, seen
    steps = open_run(str(crossed_topk)).records(0, "train").done("update").numbers.steps
    assert steps and all(np.isfinite(s["loss"]) and s["loss"] > 0 and s["grad_norm"] > 0 for s in steps)


def test_a_teacher_engine_gives_the_modules_numbers(crossed_topk, rolled_out, pair_teacher, tmp_path):
    """score.backend vllm: the teacher's vLLM engine reads its own rendering and tokens, and the stored
    columns equal the module's (the top-k's rest from 1 - sum p there)."""
    url = tmp_path / "engine"
    invoke_ok("fork", rolled_out, url, "--from-round", "0", f"teacher={pair_teacher}", "score.cross_tokenizer=true",
              "method.name=reverse_kl", "score.teacher_topk=8", "score.backend=vllm")
    run_stages(url, "score", "normalize", "train")
    module = {s["rollout_id"]: s for s in committed_rows(crossed_topk, "score")}
    # Two float32 forwards of the teacher (engine, module): within the chain's rounding at the size its
    # log-probs are bounded by; the engine's rest is 1 - sum of 8 top-k p, so its mass moves by at most
    # sum_k p_k (atol + rtol * |lp_k|) <= 2 * atol, and by that sum's own rounding.
    tol = model_logprob_tol(pair_teacher)
    for s in committed_rows(url, "score"):
        want = module[s["rollout_id"]]
        assert s["aligned"] == want["aligned"] and s["teacher_topk_ids"] == want["teacher_topk_ids"]
        for column in ("teacher_logprobs", "teacher_topk_logprobs"):
            np.testing.assert_allclose(np.asarray(s[column]), np.asarray(want[column]), err_msg=column, **tol)
        np.testing.assert_allclose(np.exp(np.asarray(s["teacher_rest_logprob"], np.float64)), np.exp(np.asarray(want["teacher_rest_logprob"], np.float64)),
                                   rtol=0, atol=2 * tol["atol"] + float32_sum_tol(8, 1.0)["atol"], err_msg="rest mass")


def scored_fork(rolled_out, folder, *settings, stages=("score",)):
    invoke_ok("fork", rolled_out, folder, "--from-round", "0", "score.cross_tokenizer=true", "teacher=", *settings)
    run_stages(folder, *stages)
    return {s["rollout_id"]: s for s in committed_rows(folder, "score")}


def test_several_teachers_each_with_its_own_tokenizer(crossed_topk, rolled_out, pair_teacher, other_teacher, tmp_path):
    """Routed: each row's columns are those its teacher alone gives (a reverse-KL round, through train);
    mixed (score.teacher_mix mean): each token's teacher value is log((p_a + p_b) / 2) of the two
    teachers' own values, and a token counts where both aligned it."""
    alone = {"a": {s["rollout_id"]: s for s in committed_rows(crossed_topk, "score")},
             "b": scored_fork(rolled_out, tmp_path / "b", f"teacher={other_teacher}", "method.name=reverse_kl", "score.teacher_topk=8")}
    teachers = f"teachers={{a: {pair_teacher}, b: {other_teacher}}}"
    routed = scored_fork(rolled_out, tmp_path / "route", teachers, "method.name=reverse_kl", "score.teacher_topk=8",
                         stages=("score", "normalize", "train"))
    prompts = {p["prompt_id"]: p["teacher"] for p in open_run(str(tmp_path / "route")).prompts("train")}
    rollouts = {r["rollout_id"]: r for r in committed_rows(rolled_out)}
    tol = model_logprob_tol(pair_teacher, other_teacher)
    assert {s["teacher"] for s in routed.values()} == {"a", "b"}
    for rid, s in routed.items():
        assert s["teacher"] == prompts[rollouts[rid]["prompt_id"]]
        want = alone[s["teacher"]][rid]
        for column in ("aligned", "teacher_topk_ids"):
            assert s[column] == want[column], column
        # Routed, a teacher scores a subset of the rows in batches of other shapes, and the matrix
        # kernels may round otherwise: within a float32 forward's rounding at the size the two
        # teachers' log-probs (and the rest, a log-sum-exp of them) are bounded by.
        for column in ("teacher_logprobs", "teacher_topk_logprobs", "teacher_rest_logprob"):
            np.testing.assert_allclose(np.asarray(s[column], np.float64), np.asarray(want[column], np.float64), err_msg=column, **tol)
    assert open_run(str(tmp_path / "route")).records(0, "train").manifest() is not None
    mixed = scored_fork(rolled_out, tmp_path / "mean", teachers, "score.teacher_mix=mean", stages=("score", "normalize", "train"))
    for rid, s in mixed.items():
        a, b = (np.asarray(alone[t][rid]["teacher_logprobs"], np.float64) for t in "ab")
        np.testing.assert_allclose(s["teacher_logprobs"], np.log((np.exp(a) + np.exp(b)) / 2), **tol)  # no further than a or b
        assert s["aligned"] == np.minimum(alone["a"][rid]["aligned"], alone["b"][rid]["aligned"]).tolist()
        assert s["teacher"] == "mean(a,b)"


def test_a_guided_prefix_is_the_teachers_text_in_the_students_tokens(pair_teacher, tiny_assets, tmp_path):
    """rollout.guided_fraction with a teacher of another tokenizer: the teacher reads the prompt through
    its own template and samples its own tokens with the request's seed (re-derived here); the prefix
    is their text in the student's tokens, masked out of the loss, and the round scores across tokenizers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gndpo.stages.rollout import sample_seed
    from tests.conftest import tiny_config_dict, write_config

    cfg = tiny_config_dict(tiny_assets, teacher=str(pair_teacher), score={"cross_tokenizer": True},
                           rollout={"guided_fraction": 0.5, "guide_prefix_tokens": 3, "prompts_per_round": 8, "eval_heldout": False})
    run = tmp_path / "run"
    invoke_ok("init", run, "--config", write_config(tmp_path, cfg))
    run_stages(run, "rollout", "score", "normalize", "train")
    tok = AutoTokenizer.from_pretrained(str(pair_teacher))
    model = AutoModelForCausalLM.from_pretrained(str(pair_teacher)).eval()
    student_tok = AutoTokenizer.from_pretrained(str(tiny_assets / "student"))
    prompts = {p["prompt_id"]: p for p in open_run(str(run)).prompts("train")}
    guided = [r for r in committed_rows(run) if r["teacher_prefix_len"] > 0]
    assert 0 < len(guided) < 16
    for r in guided:
        gen = torch.Generator().manual_seed(sample_seed(0, 0, r["prompt_id"], r["sample_idx"]))
        text = tok.apply_chat_template([{"role": "user", "content": prompts[r["prompt_id"]]["prompt"]}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        own = []
        with torch.no_grad():
            while len(own) < 3 and (not own or own[-1] != tok.eos_token_id):
                probs = torch.softmax(model(input_ids=torch.tensor([ids + own])).logits[0, -1].float(), -1)
                own.append(int(torch.multinomial(probs, 1, generator=gen)))
        ended = own[-1] == tok.eos_token_id
        want = student_tok(tok.decode(own, skip_special_tokens=True), add_special_tokens=False)["input_ids"][: 3 - ended]
        want += [student_tok.eos_token_id] if ended else []
        k = r["teacher_prefix_len"]
        assert r["response_token_ids"][:k] == want and r["loss_mask"][:k] == [0] * k
    assert open_run(str(run)).records(0, "train").manifest() is not None


def test_a_privileged_context_reaches_a_teacher_of_another_tokenizer(rolled_out, pair_teacher, tmp_path):
    """teacher_context.messages (self-distillation's privileged context, here the answer before the
    question) with a teacher of another tokenizer: the teacher reads the context through its own
    template; each response's values add up to its log-prob of the text after that prompt, and of its
    end of turn, here the text "=1" (score.teacher_end_text, as for a base model whose turns end with
    a separator), whose first token stands for the student's EOS in the top-k."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gndpo.pipeline.methods.losses import NO_ENTRY_ID

    scores = scored_fork(rolled_out, tmp_path / "context", f"teacher={pair_teacher}", "score.teacher_end_text='=1'",
                         'teacher_context.messages=[{role: user, content: "{answer}={prompt}"}]', "method.name=forward_kl",
                         "score.teacher_topk=8", stages=("score", "normalize", "train"))
    tok = AutoTokenizer.from_pretrained(str(pair_teacher))
    model = AutoModelForCausalLM.from_pretrained(str(pair_teacher)).eval()
    student_tok = AutoTokenizer.from_pretrained(str(open_run(str(rolled_out)).cfg.student))
    prompts = {p["prompt_id"]: p for p in open_run(str(tmp_path / "context")).prompts("train")}
    ends = 0
    for r in committed_rows(rolled_out)[:8]:
        s, ids, row = scores[r["rollout_id"]], r["response_token_ids"], prompts[r["prompt_id"]]
        eos = ids[-1] == student_tok.eos_token_id
        end_ids = tok("=1", add_special_tokens=False)["input_ids"]
        _, lps, end_lp, tol = teacher_view(tok, model, f"{row['answer']}={row['prompt']}", student_tok.decode(ids, skip_special_tokens=True), eos, end_ids)
        aligned = np.asarray(s["aligned"]) == 1
        want = sum(lps) + (end_lp if eos else 0.0)
        # Sums of the teacher's log-probs, each within atol + rtol * |lp| <= 2 * atol of its forward's here.
        got = float(np.sum(np.asarray(s["teacher_logprobs"], np.float64)[aligned]))
        assert got == pytest.approx(want, abs=2 * tol["atol"] * (len(lps) + eos * len(end_ids)))
        if eos:
            assert s["teacher_logprobs"][-1] == pytest.approx(end_lp, abs=2 * tol["atol"] * len(end_ids))
            top = s["teacher_topk_ids"][-1]
            assert top[0] != NO_ENTRY_ID and student_tok.convert_tokens_to_ids("=") not in top  # "=" is the end here
            ends += 1
    assert ends > 0


def test_methods_that_need_one_vocabulary_are_refused():
    for method in ({"name": "eopd"}, {"name": "gndpo", "tip": {"enabled": True}}):
        with pytest.raises(GndpoError, match="defined at every position over one vocabulary"):
            check_teacher_backend(config_from_dict({"method": method, "score": {"cross_tokenizer": True}}))
    for method in ({"name": "reopold"}, {"name": "forward_kl"}, {"name": "tropd"}):
        check_teacher_backend(config_from_dict({"method": method, "score": {"cross_tokenizer": True}}))
    with pytest.raises(GndpoError, match="score.teacher_mix mean with score.cross_tokenizer mixes sampled-token log-probs only"):
        check_teacher_backend(config_from_dict({"method": {"name": "jsd"}, "score": {"cross_tokenizer": True, "teacher_mix": "mean"},
                                        "teachers": {"a": "x", "b": "y"}}))
    with pytest.raises(GndpoError, match="method.topk_form bucket only"):
        check_teacher_backend(config_from_dict({"method": {"name": "jsd", "topk_form": "renormalized"}, "score": {"cross_tokenizer": True}}))
    for combination in ({"rollout": {"tools": ["calculator"]}}, {"rollout": {"guided_fraction": 0.5}},
                        {"teachers": {"a": "x", "b": "y"}}, {"score": {"cross_tokenizer": True, "backend": "vllm"}}):
        config_from_dict({"score": {"cross_tokenizer": True}, **combination})  # each formerly refused


def test_the_toy_builder_makes_a_teacher_with_its_own_tokenizer(tiny_assets, cache_dir):
    from transformers import AutoTokenizer

    from gndpo.apps.demos.arithmetic import ModelSpec, ToySpec, ensure_cross_tokenizer_assets
    from tests.conftest import TINY

    spec = ToySpec(**TINY, model=ModelSpec(layers=1, hidden=64, heads=2, max_steps=20, lr=3e-3, batch=32), student_max_steps=5)
    assets = ensure_cross_tokenizer_assets(spec, log=lambda *_: None)
    student, teacher = (AutoTokenizer.from_pretrained(str(assets / role)) for role in ("student", "teacher"))
    assert student("11+22=")["input_ids"] != teacher("11+22=")["input_ids"]
    assert teacher.decode(teacher("11+22=", add_special_tokens=False)["input_ids"]) == "11+22="
    assert (assets / "train.jsonl").read_text() == (tiny_assets / "train.jsonl").read_text()
    info = json.loads((assets / "info.json").read_text())
    assert "teacher_heldout_accuracy" in info and info["teacher_tokenizer"]
