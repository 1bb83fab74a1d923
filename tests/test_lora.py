"""LoRA students (``model.lora``): the merged weights against a re-derivation, the adapters' files, and
toy runs whose rounds train adapters only.

The merge is checked against ``W + alpha / rank * B @ A`` computed here from the adapter tensors, the
adapters against PEFT's own loader. The runs: one `gndpo run` of 2 rounds in this process (its
DeepSpeed engine kept between rounds), and the same run made by two calls, the second a new process
continuing from round 0's exported adapters and optimizer state, killed after an in-round checkpoint and
rerun: both must export the same weights, byte for byte, and leave every tensor outside the adapters'
layers as the initial student had it.
"""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import EngineConfig
from gndpo.stages.models.lora import adapted_student, add_adapters, load_adapter, merged_state_dict, save_adapter, without_adapters
from gndpo.stages.models.vllm_engine import AdapterEngine, adapter_request, forced_logprobs, make_llm, shutdown_llm
from tests.conftest import (
    assert_one_line_error,
    committed_rows,
    float32_sum_tol,
    gndpo_killed,
    invoke,
    invoke_ok,
    model_logprob_tol,
    model_logprobs,
    run_log,
    run_stages,
    tiny_config_dict,
    write_config,
)

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=False)


def lora_settings(**changes):
    return SimpleNamespace(**{"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["all-linear"],
                              "train_output_layer": False, "train_embeddings": False, **changes})


def adapted_model(seed: int = 0, **changes):
    """The tiny Llama with adapters whose B is not zero (a fresh B is, and merges to nothing)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(TINY)
    add_adapters(model, lora_settings(**changes), "base")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or (changes.get("train_output_layer") and "lm_head" in name):
                param.normal_(0, 0.1)
    return model


def test_merged_weights_are_w_plus_scaled_b_a():
    model = adapted_model()
    params = dict(model.named_parameters())
    merged = merged_state_dict(model)
    scale = 8.0 / 4
    targets = [n.removesuffix(".base_layer.weight") for n in params if n.endswith(".base_layer.weight")]
    assert len(targets) == 14  # q, k, v, o, gate, up, down in each of 2 layers
    for name in targets:
        w, b, a = (params[f"{name}.{part}.weight"] for part in ("base_layer", "lora_B.default", "lora_A.default"))
        want = w + scale * b @ a
        # A rank-4 dot product, scaled and added to W, in another order: its rounding at the terms' size.
        terms = (w.abs() + scale * b.abs() @ a.abs()).max()
        torch.testing.assert_close(merged[f"{name}.weight"], want, **float32_sum_tol(4 + 2, float(terms)))
    assert not [n for n in merged if "lora_" in n or "base_layer" in n]
    torch.manual_seed(0)
    untouched = LlamaForCausalLM(TINY).state_dict()
    assert merged.keys() == untouched.keys()
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        torch.testing.assert_close(merged[name], untouched[name], rtol=0, atol=0)
    plain = LlamaForCausalLM(TINY)
    plain.load_state_dict(merged)
    ids = torch.randint(0, 64, (2, 9))
    # Two float32 forwards (merged weights; base plus adapters): a logit's chain's rounding at the size
    # the model's logits are bounded by (tests/conftest.py; the adapters' rank-4 sums add little to it).
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, **model_logprob_tol(plain))


@pytest.mark.parametrize("output_layer", [False, True])
def test_saved_adapters_load_into_a_fresh_student_and_into_peft(tmp_path, output_layer):
    model = adapted_model(train_output_layer=output_layer)
    assert {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n} == ({"lm_head.weight"} if output_layer else set())
    save_adapter(model, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 4
    ids = torch.randint(0, 64, (2, 9))
    want = model(ids).logits
    again = adapted_model(seed=0, train_output_layer=output_layer)
    with torch.no_grad():  # other adapter values than the saved ones, before loading
        for name, param in again.named_parameters():
            if param.requires_grad:
                param.add_(1.0)
    load_adapter(again, tmp_path)
    torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)
    torch.manual_seed(0)
    peft = PeftModel.from_pretrained(LlamaForCausalLM(TINY), str(tmp_path))
    torch.testing.assert_close(peft(ids).logits, want, **model_logprob_tol(peft.get_base_model()))  # two float32 forwards, as above
    with pytest.raises(ValueError, match="do not fit"):
        load_adapter(adapted_model(rank=4, target_modules=["q_proj"]), tmp_path)


def test_the_base_without_adapters_shares_the_students_weights():
    """The frozen self-teacher of a LoRA student: the base model's forward, bit for bit, computed on the
    student's own base tensors (the same storage), while the student keeps its adapters."""
    model = adapted_model()
    base = without_adapters(model)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(TINY)  # the weights under the adapters (adapted_model seeds them alike)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(base(ids).logits, plain(ids).logits, rtol=0, atol=0)
        assert (model(ids).logits - plain(ids).logits).abs().max() > 1e-3  # the student still adapts
    shared = dict(model.named_parameters())
    for name, param in base.named_parameters():
        if ".lora_" not in name:
            assert param.data_ptr() == shared[name].data_ptr(), name
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


def test_export_refuses_a_run_with_no_trained_policy(tiny_config, tmp_path):
    invoke_ok("init", tmp_path / "run", "--config", tiny_config)
    assert_one_line_error(invoke("export", tmp_path / "run", tmp_path / "out"), "has no trained policy yet")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("setting, message", [
    ({"teacher": "self", "self_teacher": {"weights": "ema"}}, "model.lora cannot be combined with self_teacher.weights ema"),
    ({"model": {"lora": {"enabled": True, "target_modules": []}}}, "model.lora.target_modules must name modules"),
])
def test_lora_refusals(setting, message):
    data = {"student": "s", "teacher": "t", "data": {"train": "x"}, "model": {"lora": {"enabled": True}}}
    for key, value in setting.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(GndpoError, match=message):
        config_from_dict(data)


def new_run(folder, assets, train: dict | None = None, serve: str = "adapters", lora: dict | None = None):
    """A toy LoRA run; ``serve`` adapters (vLLM's LoRA, which auto leaves to GPUs) so that it runs here."""
    folder.mkdir(parents=True, exist_ok=True)
    run = folder / "run"
    lora = {"enabled": True, "rank": 4, "alpha": 8, "serve": serve, **(lora or {})}
    cfg = tiny_config_dict(assets, model={"lora": lora}, rollout={"eval_heldout": False}, train=train or {"lr": 1e-2})
    invoke_ok("init", run, "--config", write_config(folder, cfg))
    return run


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_assets):
    """(2 rounds in this process with the kept engine, the same 2 rounds split: round 0 in this process,
    round 1 in a new process that continues from round 0's files, checkpoints after its first step and
    is killed in its second, then rerun here from the checkpoint)."""
    kept = new_run(tmp_path_factory.mktemp("kept"), tiny_assets)
    invoke_ok("run", kept, "--rounds", 2)
    folder = tmp_path_factory.mktemp("split")
    # final_state: round 0, the first call's last round, writes the state round 1 continues from.
    split = new_run(folder, tiny_assets, train={"lr": 1e-2, "checkpoint_every": 1, "final_state": True})
    invoke_ok("run", split, "--rounds", 1)
    # Killed after step 2 of 2: the checkpoint after step 1 is there (none is taken after the last step).
    crash = {"GNDPO_CRASH_AT": "train.step", "GNDPO_CRASH_AFTER": "1"}
    assert gndpo_killed("run", split, "--rounds", 2, env=crash, log=folder / "crash.log") == -9
    invoke_ok("run", split, "--rounds", 2)
    return kept, split


def export_dir(run, round_idx: int):
    return run / open_run(str(run)).records(round_idx, "train").manifest().metrics["model_dir"]


@pytest.mark.slow
def test_lora_rounds_train_the_adapters_only_and_continue_them_from_their_files(lora_runs, tiny_assets):
    """The split run's round 1 (a new process from round 0's files, killed after an in-round checkpoint,
    which DeepSpeed writes without the frozen base, and resumed from it) exports the kept run's merged
    weights and adapters byte for byte; only the adapted layers moved."""
    kept, split = lora_runs
    initial = load_file(str(tiny_assets / "student" / "model.safetensors"))
    resumed = open_run(str(split)).records(1, "train").manifest().units[0]
    assert resumed.attempt == 2 and resumed.numbers.resumed_after_step == 1
    assert "resuming after step 1 from a checkpoint" in run_log(split)
    for round_idx in range(2):
        got, want = (load_file(str(export_dir(r, round_idx) / "model.safetensors")) for r in (split, kept))
        assert got.keys() == want.keys() == initial.keys()
        for name in want:  # a new process continues from the files exactly where the kept engine went on
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"round {round_idx} {name}")
        changed = {n for n in want if not np.array_equal(want[n], initial[n])}
        assert changed and all(n.endswith("_proj.weight") for n in changed), sorted(changed)
        adapters = [(export_dir(r, round_idx) / "adapter" / "adapter_model.safetensors").read_bytes() for r in (split, kept)]
        assert adapters[0] == adapters[1]
    # The carried state is the adapters' (and their moments): a fraction of the exported policy.
    commit = open_run(str(split)).records(0, "train").manifest().units[0]
    state = commit.numbers.optimizer_state
    state = json.loads((split / state["pending"]).read_text()) if "pending" in state else state
    export_bytes = sum(f.bytes for f in commit.files if "/model/" in f.path)
    assert 0 < sum(f["bytes"] for f in state["files"]) < 0.5 * export_bytes
    for run in (kept, split):  # round 1's engine: the initial student with round 0's adapters, through vLLM's LoRA
        probe = open_run(str(run)).records(1, "rollout").manifest().metrics
        assert probe["engine_adapters"] == 1 and probe["engine_probe_gap_mean"] < 1e-4, probe


@pytest.mark.slow
def test_a_later_train_starts_from_the_initial_student_plus_the_exported_adapters(lora_runs, tiny_assets):
    """What train builds for round 1 from round 0's export, in a fresh process (no optimizer state to
    restore the adapters): merged, exactly round 0's exported weights; for round 0, the initial student."""
    kept, _ = lora_runs
    cfg = open_run(str(kept)).cfg
    for policy, want in ((export_dir(kept, 0), export_dir(kept, 0)), (tiny_assets / "student", tiny_assets / "student")):
        torch.manual_seed(cfg.train.seed)
        model = adapted_student(str(policy), str(tiny_assets / "student"), cfg.model, torch.device("cpu"), torch.float32)
        expected = load_file(str(want / "model.safetensors"))
        merged = merged_state_dict(model)
        for name in expected:
            np.testing.assert_array_equal(merged[name].numpy(), expected[name], err_msg=f"{policy} {name}")


@pytest.mark.slow
def test_lora_under_zero_2_exports_the_zero_0_weights(lora_runs, tmp_path, tiny_assets):
    """The same rounds with the adapters' optimizer partitioned (ZeRO-2, one rank) and the merged
    weights served (model.lora.serve merged, the CPU's auto): round 0's export equals the ZeRO-0
    run's to float rounding, the adapters file holds adapters only, and round 1's kept engine, reloaded
    with the merged weights, passes the probe."""
    kept, _ = lora_runs
    run = new_run(tmp_path, tiny_assets, train={"lr": 1e-2, "zero_stage": 2}, serve="merged")
    invoke_ok("run", run, "--rounds", 2)
    got, want = (load_file(str(export_dir(r, 0) / "model.safetensors")) for r in (run, kept))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    adapter = load_file(str(export_dir(run, 0) / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".lora_" in k for k in adapter)
    probe = open_run(str(run)).records(1, "rollout").manifest().metrics
    assert "engine_adapters" not in probe and probe["engine_reloaded"] == 1 and probe["engine_probe_gap_mean"] < 1e-4, probe


@pytest.mark.slow
@pytest.mark.parametrize("output_layer", [False, True])
def test_lora_under_zero_3_exports_the_zero_0_weights(lora_runs, tmp_path, tiny_assets, output_layer):
    """The same rounds with the base weights and the adapters partitioned (ZeRO-3, one rank; a frozen
    output layer's chunks recomputed in backward), and with the output layer trained in full beside
    the adapters: each round's merged export and adapters equal the ZeRO-0 run's to float rounding,
    and round 1 continues from round 0's adapters and optimizer state as ZeRO-0 does."""
    kept, _ = lora_runs
    lora = {"train_output_layer": True} if output_layer else {}
    run = new_run(tmp_path / "zero3", tiny_assets, train={"lr": 1e-2, "zero_stage": 3}, lora=lora)
    invoke_ok("run", run, "--rounds", 2)
    if output_layer:
        kept = new_run(tmp_path / "zero0", tiny_assets, lora=lora)
        invoke_ok("run", kept, "--rounds", 2)
    for round_idx in range(2):
        for file in ("model.safetensors", "adapter/adapter_model.safetensors"):
            got, want = (load_file(str(export_dir(r, round_idx) / file)) for r in (run, kept))
            assert got.keys() == want.keys(), file
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=f"round {round_idx} {file} {name}")


@pytest.mark.slow
def test_the_engine_serving_the_adapters_gives_the_merged_models_logprobs(lora_runs, tiny_assets):
    """vLLM with round 0's adapters on the initial student (what round 1's rollout runs), read as the
    probe reads it (one-token generations restricted to each token), against a transformers forward of
    the merged weights train exported; and without adapters, against the initial student's forward."""
    kept, _ = lora_runs
    sequences = [[1, 3, 4, 5, 6, 7, 8], [1, 9, 10, 11, 12, 3]]
    prompts, responses = [s[:1] for s in sequences], [s[1:] for s in sequences]

    def transformers_logprobs(folder) -> np.ndarray:
        model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
        with torch.no_grad():
            return np.concatenate([model(torch.tensor([s])).logits.log_softmax(-1)[0, :-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0].numpy()
                                   for s in sequences])

    export = export_dir(kept, 0)
    llm = make_llm(str(tiny_assets / "student"), EngineConfig(max_model_len=32, in_process=True), lora_rank=4)
    try:
        # Two float32 forwards each (the engine's, transformers'), within their rounding (tests/conftest.py).
        served = forced_logprobs(AdapterEngine(llm, adapter_request(str(export / "adapter"), 1)), prompts, responses)
        np.testing.assert_allclose(served, transformers_logprobs(export), **model_logprob_tol(export))
        base = forced_logprobs(AdapterEngine(llm, None), prompts, responses)
        np.testing.assert_allclose(base, transformers_logprobs(tiny_assets / "student"), **model_logprob_tol(tiny_assets / "student"))
        assert np.abs(served - base).max() > 1e-3  # the adapters changed what the engine computes
    finally:
        shutdown_llm(llm)


@pytest.mark.slow
def test_a_lora_state_not_written_is_replayed_to_the_same_adapters(lora_runs, tmp_path, tiny_assets):
    """train.state_every 2: round 0 keeps its adapters' optimizer state in memory only, and a second
    `gndpo run` trains round 1. It replays round 0 from fresh seeded adapters, checks the replay ends on
    round 0's merged export byte for byte, and exports the kept run's round-1 weights exactly."""
    kept, _ = lora_runs
    run = new_run(tmp_path, tiny_assets, train={"lr": 1e-2, "state_every": 2})
    invoke_ok("run", run, "--rounds", 1)  # round 0 here; its state leaves with this call's kept engine
    invoke_ok("run", run, "--rounds", 2)  # a new call: its models (made by this call) never held the state
    log = run_log(run)
    assert "optimizer state replayed from round 0 to round 0" in log, log[-3000:]
    got, want = (load_file(str(export_dir(r, 1) / "model.safetensors")) for r in (run, kept))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.slow
def test_score_runs_the_student_as_base_plus_adapters_and_the_initial_student_as_the_base(lora_runs, tmp_path, tiny_assets):
    """Round 1 scored again with the initial student as the teacher (a frozen self-teacher's weights):
    the student's column is the initial student with round 0's adapters as PEFT computes them, the
    teacher's the initial student's own forward, the base under the same module's adapters."""
    kept, _ = lora_runs
    student = tiny_assets / "student"
    new = tmp_path / "run"
    invoke_ok("fork", kept, new, "--from-round", "1", f"teacher={student}")
    run_stages(new, "score", round_idx=1)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(student)), str(export_dir(kept, 0) / "adapter"))
    rollouts = {r["rollout_id"]: r for r in committed_rows(kept, "rollout", 1)}
    scores = committed_rows(new, "score", 1)
    assert len(scores) == len(rollouts)
    # Two float32 forwards of each; the adapters change neither the head nor the final norm, so the
    # base's bound on the logits is the adapted student's too (tests/conftest.py).
    tol = model_logprob_tol(student)
    for s in scores[:4]:
        r = rollouts[s["rollout_id"]]
        np.testing.assert_allclose(s["student_logprobs"], model_logprobs(adapted, r["prompt_token_ids"], r["response_token_ids"]), **tol)
        np.testing.assert_allclose(s["teacher_logprobs"], model_logprobs(student, r["prompt_token_ids"], r["response_token_ids"]), **tol)
        assert np.abs(np.subtract(s["student_logprobs"], s["teacher_logprobs"])).max() > 1e-4  # round 0 moved the student


@pytest.mark.slow
def test_export_writes_the_merged_student_or_its_adapters_and_refuses_what_it_cannot(lora_runs, tmp_path, tiny_assets):
    """`gndpo export`: the newest policy as a Hugging Face folder of the merged weights (the run's own
    export, byte for byte, without gndpo's probe), or with --adapters the PEFT adapters, which
    PeftModel reads onto the initial student to compute what the merged folder computes. A file that
    no longer matches its commit record, an OUT in use, a policy that does not exist: one line, and
    no OUT."""
    kept, _ = lora_runs
    merged, adapters = tmp_path / "merged", tmp_path / "adapters"
    invoke_ok("export", kept, merged)
    invoke_ok("export", kept, adapters, "--adapters")
    committed = export_dir(kept, 1)
    assert sorted(p.name for p in merged.iterdir()) == sorted(p.name for p in committed.iterdir() if p.name not in ("adapter", "gndpo_probe.json"))
    assert (merged / "model.safetensors").read_bytes() == (committed / "model.safetensors").read_bytes()
    assert sorted(p.name for p in adapters.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    ids = torch.tensor([[1, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(merged))(ids).logits
        got = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_assets / "student")), str(adapters))(ids).logits
    torch.testing.assert_close(got, want, **model_logprob_tol(merged))  # two float32 forwards (tests/conftest.py)
    invoke_ok("export", kept, tmp_path / "v1", "--policy", "1")
    assert (tmp_path / "v1" / "model.safetensors").read_bytes() == (export_dir(kept, 0) / "model.safetensors").read_bytes()

    assert_one_line_error(invoke("export", kept, merged), "exists and is not an empty folder")
    assert_one_line_error(invoke("export", kept, tmp_path / "v9", "--policy", "9"), "has no policy v9; its trained policies are v1 to v2")
    tampered = tmp_path / "tampered"
    shutil.copytree(kept, tampered)
    weights = tampered / export_dir(kept, 1).relative_to(kept) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert_one_line_error(invoke("export", tampered, tmp_path / "bad"), "model.safetensors differs from its commit record")
    assert not (tmp_path / "bad").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".bad")]

