"""Vision-language models: prompts with images through init, rollout (vLLM), score and train.

The pair is a tiny random-weight Idefics3 (the SmolVLM family; :mod:`gndpo.apps.demos.vision`), the
images small PNGs drawn here. What a stage computes is re-derived from a plain transformers forward
with the processor's tensors; bad image data is refused at init, one line each.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file

from gndpo.apps.demos.vision import VisionModelSpec, build_random_vision_pair
from tests.conftest import (
    assert_one_line_error,
    built_once,
    committed_rows,
    invoke,
    invoke_ok,
    model_logprob_tol,
    run_stages,
    shared_folder,
    tiny_config_dict,
    write_config,
)

SPEC = VisionModelSpec()
IMAGE_TOKENS_PER_PICTURE = SPEC.image_seq_len + 3  # <fake><global-img> 16 x <image> <fake>


def picture(number: int) -> bytes:
    im = Image.new("RGB", (SPEC.image_size, SPEC.image_size), "white")
    ImageDraw.Draw(im).text((12, 24), str(number), fill="black")
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def write_prompts(folder, count: int, offset: int = 0, name: str = "train.jsonl") -> str:
    """``count`` rows "<image>?" -> the number drawn, each picture a PNG file beside the prompts."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(offset, offset + count):
        number = 10 + 7 * i
        (folder / "img" / f"{i}.png").write_bytes(picture(number))
        lines.append(json.dumps({"prompt": "<image>n?", "answer": str(number), "images": [f"img/{i}.png"]}))
    (folder / name).write_text("\n".join(lines) + "\n")
    return str(folder / name)


def write_geo3k_prompts(folder, count: int, offset: int = 0, name: str = "train.parquet") -> str:
    """The rows of :func:`write_prompts` in geo3k's verl Parquet layout: ``prompt`` as chat messages
    with ``<image>``, ``images`` as ``{bytes, path}`` structs, the answer in ``reward_model.ground_truth``."""
    import pyarrow as pa

    numbers = [10 + 7 * i for i in range(offset, offset + count)]
    pq.write_table(pa.table({
        "prompt": [[{"role": "user", "content": "<image>n?"}] for _ in numbers],
        "images": [[{"bytes": picture(n), "path": f"{n}.png"}] for n in numbers],
        "reward_model": [{"ground_truth": str(n), "style": "rule"} for n in numbers],
    }), folder / name)
    return str(folder / name)


GEO3K_KEYS = {"messages_key": "prompt", "answer_key": "reward_model.ground_truth"}


@pytest.fixture(scope="session")
def vision_pair(tmp_path_factory):
    folder = shared_folder(tmp_path_factory, "vision-pair")
    with built_once(folder) as build:
        if build:
            build_random_vision_pair(folder, SPEC)
    return folder


# Teachers that read the pictures their own way.
@pytest.fixture(scope="module")
def low_resolution_teacher(tmp_path_factory):
    """A teacher with the student's tokenizer but its own processor: 32x32 pictures, 4 image tokens each
    (the student reads 64x64 pictures as 16), like a teacher of another size or resolution."""
    from gndpo.apps.demos.vision import new_vision_model, save_vision_model, vision_processor, vision_tokenizer

    spec = VisionModelSpec(image_size=32, layers=3)
    tok = vision_tokenizer(spec.context)
    return save_vision_model(new_vision_model(spec, tok, seed=2), vision_processor(spec, tok), tmp_path_factory.mktemp("teacher32") / "teacher")


@pytest.fixture(scope="module")
def other_tokenizer_teachers(tmp_path_factory):
    """Two teachers whose token ids are not the student's (their character alphabet in reverse order):
    a text-only Llama, which can only read a caption, and an Idefics3 reading 32x32 pictures."""
    import string

    from transformers import LlamaConfig, LlamaForCausalLM

    from gndpo.apps.demos.arithmetic import character_tokenizer
    from gndpo.apps.demos.vision import CHAT_TEMPLATE, END_OF_UTTERANCE, IMAGE_TOKENS, ROLE_TOKENS, new_vision_model, save_vision_model, vision_processor

    folder = tmp_path_factory.mktemp("other-tokenizer")
    reverse = string.printable[:95][::-1]
    text_tok = character_tokenizer(reverse, model_max_length=256)
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=len(text_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         max_position_embeddings=256, bos_token_id=text_tok.bos_token_id, eos_token_id=text_tok.eos_token_id,
                         pad_token_id=text_tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder / "text")
    text_tok.save_pretrained(folder / "text")
    vision_tok = character_tokenizer(reverse, model_max_length=256)
    vision_tok.add_special_tokens({"additional_special_tokens": [*IMAGE_TOKENS, END_OF_UTTERANCE, *ROLE_TOKENS]})
    vision_tok.chat_template = CHAT_TEMPLATE
    spec = VisionModelSpec(image_size=32)
    save_vision_model(new_vision_model(spec, vision_tok, seed=4), vision_processor(spec, vision_tok), folder / "vision")
    return folder


def vision_config(folder, pair, **sections) -> dict:
    cfg = tiny_config_dict(pair, **{
        "rollout": {"prompts_per_round": 4, "n": 2, "prompts_per_unit": 4, "max_tokens": 6, "eval_heldout": True},
        "score": {"rows_per_chunk": 4},
        "train": {"optimizer_steps": 1, "micro_batch_size": 8, "lr": 1e-2},
        "engine": {"max_model_len": 64},
        **sections,
    })
    cfg["data"] = {"train": write_prompts(folder, 6), "heldout": write_prompts(folder, 3, offset=20, name="heldout.jsonl")}
    return cfg


# -- fast: init refuses bad image data, one line each ------------------------------------------------
@pytest.mark.parametrize("damage, fragments", [
    ("missing", ["image not found", "img/0.png"]),
    ("garbage", ["row 1, image 1", "cannot be decoded as an image"]),
    ("extra", ["row 1", "2 image(s) but 1 placeholder(s)"]),
])
def test_init_refuses_bad_images(tmp_path, vision_pair, damage, fragments):
    cfg = vision_config(tmp_path, vision_pair)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    if damage == "missing":
        (tmp_path / "img" / "0.png").unlink()
    elif damage == "garbage":
        (tmp_path / "img" / "0.png").write_bytes(b"not a picture")
    else:
        rows[0]["images"] = ["img/0.png", "img/1.png"]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert_one_line_error(invoke("init", tmp_path / "run", "--config", write_config(tmp_path, cfg)), *fragments)
    assert not (tmp_path / "run" / "run.yaml").exists() and not (tmp_path / "run" / "images").exists()


def test_init_refuses_images_for_a_text_student(tmp_path, vision_pair, tiny_assets):
    cfg = vision_config(tmp_path, vision_pair)
    cfg["student"], cfg["teacher"] = str(tiny_assets / "student"), str(tiny_assets / "teacher")
    assert_one_line_error(invoke("init", tmp_path / "run", "--config", write_config(tmp_path, cfg)), "has no vision tower")


def test_init_refuses_teachers_that_cannot_read_the_pictures(tmp_path, vision_pair, low_resolution_teacher, other_tokenizer_teachers):
    """A teacher context that leaves the picture out, two teachers processing pictures differently
    (score gives several teachers one set of image tensors), and a text-only teacher with nothing
    telling it what the picture shows: one line each at init."""
    cfg = vision_config(tmp_path, vision_pair)
    cfg.update(teacher="self", teacher_context={"messages": [{"role": "user", "content": "The answer is {answer}."}]})
    assert_one_line_error(invoke("init", tmp_path / "a", "--config", write_config(tmp_path, cfg)),
                          "teacher (self)", "0 image placeholder(s) for its 1 image(s)", "put {prompt}")
    cfg = vision_config(tmp_path, vision_pair)
    cfg.pop("teacher")
    cfg["teachers"] = {"a": str(vision_pair / "teacher"), "b": str(low_resolution_teacher)}
    assert_one_line_error(invoke("init", tmp_path / "b", "--config", write_config(tmp_path, cfg)), "process images differently")
    cfg = vision_config(tmp_path, vision_pair, score={"cross_tokenizer": True})
    cfg["teacher"] = str(other_tokenizer_teachers / "text")
    assert_one_line_error(invoke("init", tmp_path / "c", "--config", write_config(tmp_path, cfg)), "has no vision tower", "teacher_context.messages")
    assert not any((tmp_path / name).exists() for name in "abc")


def test_init_refuses_a_served_vision_teacher(tmp_path, vision_pair):
    """score.backend server scores token ids through /v1/completions, which takes no pictures: a
    vision-language teacher of a run whose prompts show pictures is refused before any server is asked."""
    cfg = vision_config(tmp_path, vision_pair, score={"rows_per_chunk": 4, "backend": "server", "servers": ["http://127.0.0.1:9"],
                                                      "server_model": "vision-teacher"})
    assert_one_line_error(invoke("init", tmp_path / "run", "--config", write_config(tmp_path, cfg)),
                          "cannot show the vision-language teacher", "use score.backend hf or vllm")
    assert not (tmp_path / "run" / "run.yaml").exists()


def test_init_stores_each_image_once_by_content_and_reads_geo3k_parquet(tmp_path, vision_pair):
    """geo3k's verl layout: ``prompt`` as chat messages with <image>, ``images`` as {bytes, path}
    structs, the answer in ``reward_model.ground_truth``; the same picture twice is stored once."""
    import pyarrow as pa

    same = picture(42)
    table = pa.table({
        "prompt": [[{"role": "user", "content": f"<image>Which number? {i}"}] for i in range(4)],
        "images": [[{"bytes": same if i < 2 else picture(i), "path": f"{i}.png"}] for i in range(4)],
        "reward_model": [{"ground_truth": str(i), "style": "rule"} for i in range(4)],
    })
    pq.write_table(table, tmp_path / "geo3k.parquet")
    cfg = vision_config(tmp_path, vision_pair)
    cfg["data"] = {"train": str(tmp_path / "geo3k.parquet"), "heldout": str(tmp_path / "geo3k.parquet"),
                   "messages_key": "prompt", "answer_key": "reward_model.ground_truth"}
    invoke_ok("init", tmp_path / "run", "--config", write_config(tmp_path, cfg))
    prompts = pq.read_table(tmp_path / "run" / "prompts" / "train.parquet").to_pylist()
    assert [p["answer"] for p in prompts] == ["0", "1", "2", "3"]
    ids = [json.loads(p["images"])[0] for p in prompts]
    assert ids[0] == ids[1] and len(set(ids)) == 3
    stored = sorted(p.name for p in (tmp_path / "run" / "images").rglob("*") if p.is_file())
    assert stored == sorted(set(ids))


@pytest.mark.parametrize("share_prompts", [False, True], ids=["whole-rows", "shared-prompts"])
@pytest.mark.parametrize("family", ["idefics3", "qwen2_5_vl"])
def test_the_batched_forward_with_images_equals_the_models_own_for_two_families(family, share_prompts):
    """Score's and train's forward (a right-padded batch, or the prompts' left-padded pass and the
    responses' on its cache; image tensors from the image processor, the VLM's base model, chunked output
    layer) against the model's own forward row by row, with Qwen2.5-VL's image-aware M-RoPE positions
    (gndpo gave it plain 1-D positions: 4.5e-3 off); freeze_vision leaves the vision tower without
    gradient and the language model with one."""
    from tests.vision_models import check_forward

    result = check_forward(family, torch.device("cpu"), torch.float32, share_prompts=share_prompts)
    np.testing.assert_allclose(result["logprobs"], result["reference"], **result["tolerance"])
    assert result["frozen_parameters"] > 0 and result["language_model_grads"] and not result["vision_grads"]


def test_the_engine_probe_of_a_vlm_sees_its_vision_tower(vision_pair):
    """The exported model's probe (what a reloaded engine must reproduce) has a sequence after a
    picture: a vision tower left stale by a reload changes it, while the text sequences cannot tell."""
    from transformers import AutoModelForImageTextToText

    from gndpo.stages.models.probe import probe_logprobs
    from gndpo.stages.models.vision import load_processor

    model = AutoModelForImageTextToText.from_pretrained(vision_pair / "student", dtype=torch.float32).eval()
    processor = load_processor(str(vision_pair / "student"))
    before = probe_logprobs(model, len(processor.tokenizer), 0, processor)
    with torch.no_grad():
        for p in model.model.vision_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    after = probe_logprobs(model, len(processor.tokenizer), 0, processor)
    assert after["logprobs"] == before["logprobs"]
    assert len(before["image"]["logprobs"]) == len(before["image"]["response"]) == len(before["token_ids"][0]) - 1
    assert np.abs(np.subtract(after["image"]["logprobs"], before["image"]["logprobs"])).max() > 1e-3


# -- slow: a GNDPO round end to end --------------------------------------------------------------------
@pytest.fixture(scope="module")
def vision_round(tmp_path_factory, vision_pair):
    """Round 0, then round 1's rollout and score on the same kept vLLM engine, which loads round 0's
    update (a VLM engine must reset its encoder cache too, or the next image request fails). The
    prompts are in geo3k's verl Parquet layout, so this is geo3k's GNDPO round end to end."""
    from gndpo.stages.models.live import LiveModels

    folder = tmp_path_factory.mktemp("vision-round")
    cfg = vision_config(folder, vision_pair)
    cfg["data"] = {"train": write_geo3k_prompts(folder, 6), "heldout": write_geo3k_prompts(folder, 3, offset=20, name="heldout.parquet"), **GEO3K_KEYS}
    invoke_ok("init", folder / "run", "--config", write_config(folder, cfg))
    live = LiveModels(keep=True, log=lambda *_: None)
    try:
        run_stages(folder / "run", "rollout", "score", "normalize", "train", live=live)
        run_stages(folder / "run", "rollout", "score", round_idx=1, live=live)
    finally:
        live.close()
    return folder / "run"


def forward_logprobs(model_dir, processor, rows, images, prompt_text=None) -> list[np.ndarray]:
    """Per row, log p(response token | prompt with its image, earlier tokens) from a plain forward.
    ``prompt_text(row)``: the rendered text the model reads before the response, expanded here by
    ``processor``; by default the prompt ids rollout stored."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for row in rows:
            if prompt_text is None:
                prompt = row["prompt_token_ids"]
                pixels = processor.image_processor(images=[images[row["prompt_id"]]], return_tensors="pt")
            else:
                encoded = processor(text=prompt_text(row), images=images[row["prompt_id"]], add_special_tokens=False, return_tensors="pt")
                prompt = encoded.pop("input_ids")[0].tolist()
                pixels = {k: v for k, v in encoded.items() if k != "attention_mask"}
            ids = torch.tensor([prompt + row["response_token_ids"]])
            logp = model(input_ids=ids, **pixels).logits[0].float().log_softmax(-1)
            start = len(prompt)
            targets = ids[0, start:]
            out.append(logp[start - 1 : -1].gather(-1, targets[:, None])[:, 0].numpy())
    return out


@pytest.mark.slow
def test_a_gndpo_round_reads_the_images_in_every_stage(vision_round, vision_pair):
    from transformers import AutoProcessor

    from gndpo.pipeline.run.images import RunImages
    from gndpo.pipeline.run.run import open_run

    run = open_run(str(vision_round))
    processor = AutoProcessor.from_pretrained(vision_pair / "student")
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    rollouts, scores = committed_rows(vision_round), committed_rows(vision_round, "score")
    # Rollout stored the prompt as the model read it: each placeholder expanded as the processor does.
    prompts = {p["prompt_id"]: p for p in run.prompts("train")}
    pictures = RunImages(run.fs)
    images = {pid: pictures.of(p) for pid, p in prompts.items()}
    for row in rollouts:
        assert row["prompt_token_ids"].count(image_token) == SPEC.image_seq_len
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]}],
                                             add_generation_prompt=True)
        expanded = processor(text=text, images=images[row["prompt_id"]], add_special_tokens=False)["input_ids"][0]
        assert row["prompt_token_ids"] == list(expanded)
    # Score: teacher and student log-probs equal a transformers forward with the processor's tensors,
    # within two float32 forwards' rounding (tests/conftest.py), as every comparison of log-probs here.
    by_id = {r["rollout_id"]: r for r in scores}
    tol = {role: model_logprob_tol(vision_pair / role) for role in ("teacher", "student")}
    for role, column in (("teacher", "teacher_logprobs"), ("student", "student_logprobs")):
        want = forward_logprobs(vision_pair / role, processor, rollouts, images)
        for row, ref in zip(rollouts, want):
            np.testing.assert_allclose(by_id[row["rollout_id"]][column], ref, **tol[role])
    # The sampler (vLLM, with the images) agrees with the student's forward.
    sampled = np.concatenate([r["sampler_logprobs"] for r in rollouts])
    np.testing.assert_allclose(sampled, np.concatenate([by_id[r["rollout_id"]]["student_logprobs"] for r in rollouts]), **tol["student"])
    # Train's first step recomputed score's log-probs: the importance ratio is 1, each token's exp of a
    # difference within atol + rtol * |lp| <= 2 * atol.
    train = run.records(0, "train").require_manifest().metrics
    assert abs(train["ratio_mean"] - 1.0) < 2 * tol["student"]["atol"]
    # The kept engine loaded round 0's update: on image prompts it samples from exactly those weights,
    # and the probe it checked the reload with showed it a picture (vision tower and connector included).
    later_metrics = run.records(1, "rollout").require_manifest().metrics
    assert later_metrics["engine_reloaded"] == 1 and later_metrics["engine_probe_gap_max"] < 1e-4
    assert "image" in json.loads((Path(run.policy_path(1)) / "gndpo_probe.json").read_text())
    later = {r["rollout_id"]: r for r in committed_rows(vision_round, "score", 1)}
    trained = model_logprob_tol(run.policy_path(1))
    for row in committed_rows(vision_round, "rollout", 1):
        np.testing.assert_allclose(row["sampler_logprobs"], later[row["rollout_id"]]["student_logprobs"], **trained)
    # gndpo sql: which pictures a rollout answered.
    from gndpo.pipeline.observe.sql import query

    shown = query(run, "SELECT r.rollout_id, p.images FROM rollouts r JOIN prompts p USING (prompt_id) WHERE p.split = 'train' AND r.round = 0")
    assert shown.height == len(rollouts)
    assert {json.loads(v)[0] for v in shown["images"]} == {json.loads(prompts[r["prompt_id"]]["images"])[0] for r in rollouts}
    # gndpo report shows each picture beside its response.
    from gndpo.apps.report import token_view

    assert token_view(str(vision_round)).count('<img class="picture"') >= 1
    # Held-out eval ran on the images (the random student answers nothing right, but it answered).
    rollout_metrics = run.records(0, "rollout").require_manifest().metrics
    assert "heldout_accuracy" in rollout_metrics


@pytest.mark.slow
def test_freeze_vision_trains_the_language_model_only_and_export_keeps_the_processor(vision_round, vision_pair):
    from gndpo.pipeline.run.run import open_run

    run = open_run(str(vision_round))
    exported = run.policy_path(1)
    before, after = load_file(vision_pair / "student" / "model.safetensors"), load_file(f"{exported}/model.safetensors")
    vision = [k for k in before if "vision_model" in k or "connector" in k]
    language = [k for k in before if "text_model" in k or "lm_head" in k]
    assert vision and language
    assert all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in language)
    from transformers import AutoProcessor

    assert type(AutoProcessor.from_pretrained(exported)).__name__ == "Idefics3Processor"


@pytest.mark.slow
def test_a_fork_of_a_vision_run_reads_its_pictures(vision_round, tmp_path):
    """A fork copies the parent's imported pictures with its prompt tables: its stages read them from
    its own folder, and gndpo sql sees them."""
    from gndpo.apps.fork import fork_run
    from gndpo.pipeline.observe.sql import query
    from gndpo.pipeline.run.images import RunImages

    fork = fork_run(str(vision_round), str(tmp_path / "fork"), 1)
    rows = fork.prompts("train") + fork.prompts("heldout")
    assert all(len(RunImages(fork.fs).of(row)) == 1 for row in rows)
    assert query(fork, "SELECT count(*) AS n FROM prompts WHERE images IS NOT NULL")["n"][0] == len(rows)


SMOLVLM_PROBE = r"""
import json
import torch
from gndpo.dist import usable_cpus
from gndpo.pipeline.settings.schema import ModelConfig
from gndpo.stages.models.logprobs import logits_chunk, pair_token_stats, policy_token_logprobs
from gndpo.stages.models.vision import freeze_all_but_language_model
from tests.memory import peak_above_start
from tests.vision_models import SMOLVLM_256M, smolvlm_sized
torch.set_num_threads(min(2, usable_cpus()))
model, batch = smolvlm_sized(rows=2, response=256, device=torch.device("cpu"))
chunk = logits_chunk(model, ModelConfig())
out = {"parameters": sum(p.numel() for p in model.parameters()), "image_tokens": SMOLVLM_256M.image_seq_len}
with torch.no_grad():
    out["score"], _ = peak_above_start(lambda: pair_token_stats(model, model, batch, chunk, 1.0, topk=0, entropies=(True, True), kl=False))
freeze_all_but_language_model(model)
model.train()
def step():
    logp = policy_token_logprobs(model, batch, chunk, 1.0).sampled
    logp.sum().backward()
    out["language_model_grads"] = all(p.grad is not None for p in model.get_decoder().parameters())
    out["vision_grads"] = any(p.grad is not None for p in model.model.vision_model.parameters())
out["train"], _ = peak_above_start(step)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_smolvlm_sized_model_scores_and_trains_within_the_stated_memory():
    """Realistic shapes, random weights (fp32, 2 threads): SmolVLM-256M's vision tower at 512x512 and a
    SmolLM2-135M-sized language model (49,280 logits; 241M parameters, 1.45 GiB loaded), two 256-token
    responses after a picture. Stated bounds above the loaded model: score's forward (both entropies)
    under 0.75 GiB (measured 0.29, 13 s), a train step (frozen tower, backward through the language model)
    under 2.5 GiB (measured 1.48, 6.5 s); the vision tower gets no gradient."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", SMOLVLM_PROBE], capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print("SmolVLM-sized score and train:", json.dumps(out))
    assert 2.0e8 < out["parameters"] < 3.0e8
    assert out["score"]["extra_gib"] < 0.75 and out["train"]["extra_gib"] < 2.5
    assert out["language_model_grads"] and not out["vision_grads"]




# -- slow: teachers that read the pictures their own way, tools with pictures ---------------------------
@pytest.mark.slow
@pytest.mark.parametrize("setting", ["own processor", "vllm backend", "self-distillation with a caption"])
def test_teacher_columns_equal_a_forward_of_the_teacher_reading_the_pictures_its_own_way(vision_round, vision_pair, low_resolution_teacher, tmp_path, setting):
    """Round 0's rollouts re-scored (a fork) by a teacher that reads the pictures its own way; its stored
    log-probs equal a plain transformers forward over the prompt that teacher reads, expanded by its
    own processor: a teacher with another image resolution, the vLLM score backend (prompt log-probs
    with the pictures as multi_modal_data), and self-distillation where the teacher (the student itself)
    reads the picture and its answer as a privileged caption."""
    from transformers import AutoProcessor

    from gndpo.apps.fork import fork_run
    from gndpo.pipeline.run.images import RunImages
    from gndpo.pipeline.run.run import open_run

    question = [{"type": "image"}, {"type": "text", "text": "n?"}]
    overrides, teacher = {
        "own processor": ([f"teacher={low_resolution_teacher}"], low_resolution_teacher),
        "vllm backend": (["score.backend=vllm"], vision_pair / "teacher"),
        "self-distillation with a caption": (["teacher=self", "teacher_context.messages=[{role: user, content: 'The picture shows {answer}. {prompt}'}]"],
                                             vision_pair / "student"),
    }[setting]
    fork = fork_run(str(vision_round), str(tmp_path / "fork"), 0, overrides)
    run_stages(tmp_path / "fork", "score")
    processor = AutoProcessor.from_pretrained(teacher)
    prompts = {p["prompt_id"]: p for p in fork.prompts("train")}
    if setting.startswith("self-distillation"):
        turns = lambda row: [{"role": "user", "content": f"The picture shows {prompts[row['prompt_id']]['answer']}. <image>n?"}]  # noqa: E731
    else:
        turns = lambda row: [{"role": "user", "content": question}]  # noqa: E731
    pictures = RunImages(open_run(str(vision_round)).fs)
    images = {pid: pictures.of(p) for pid, p in prompts.items()}
    rollouts = committed_rows(vision_round)
    want = forward_logprobs(teacher, processor, rollouts, images, lambda row: processor.apply_chat_template(turns(row), add_generation_prompt=True))
    scored = {r["rollout_id"]: r for r in committed_rows(tmp_path / "fork", "score")}
    tol = model_logprob_tol(teacher)  # two float32 forwards (tests/conftest.py)
    for row, ref in zip(rollouts, want):
        np.testing.assert_allclose(scored[row["rollout_id"]]["teacher_logprobs"], ref, **tol)


@pytest.mark.slow
def test_a_tool_conversation_shows_its_picture_on_every_turn(vision_pair, tmp_path):
    """Multi-turn tool use with an image prompt, through vLLM and the calculator. The random student is
    made to call the tool in its first turn (that turn's sampling is constrained to the call by vLLM's
    structured outputs) and writes its second turn freely after the tool's answer. Every turn's request
    carries the picture: the second turn's sampler log-probs equal a transformers forward over the
    expanded prompt, with the picture, and the whole conversation so far; the stored prompt is the
    processor's expansion."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm.sampling_params import StructuredOutputsParams

    from gndpo.pipeline.settings.schema import DataConfig, EngineConfig, RolloutConfig
    from gndpo.stages.models.sampling import SamplingRequest
    from gndpo.stages.models.vllm_engine import make_llm, shutdown_llm
    from gndpo.stages.samplers.vllm import VLLMSampler
    from gndpo.stages.text.agent import Conversation, ToolUse, run_conversations
    from gndpo.stages.text.chat import render_prompt

    student = vision_pair / "student"
    processor = AutoProcessor.from_pretrained(student)
    shown = Image.open(io.BytesIO(picture(37)))
    row = {"prompt_id": "p0", "prompt": "<image>What is 2+3?", "answer": "5", "images": json.dumps(["x"])}
    data = DataConfig()
    rendered = render_prompt(processor.tokenizer, row, data)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'

    class CallingFirst(VLLMSampler):
        """The engine's sampler, its first turn (seed 5) constrained to the call."""

        def params(self, request):
            params = super().params(request)
            if request.seed == 5:
                params.structured_outputs = StructuredOutputsParams(regex=call.replace("+", r"\+").replace("{", r"\{").replace("}", r"\}"))
            return params

    def sampling(seed, max_tokens, extra_stops):
        return SamplingRequest(seed, max_tokens, 1.0, stop=tuple(extra_stops), keep_stop_text=True,
                               banned={processor.tokenizer.convert_tokens_to_ids("<image>"): -1e4})

    conversation = Conversation(row, rendered.token_ids, 5, [shown])
    tools = ToolUse.from_config(RolloutConfig(tools=["calculator"], max_turns=2, max_tool_response_tokens=200))
    engine = EngineConfig(max_model_len=256)
    llm = make_llm(str(student), engine, images=1)
    try:
        run_conversations(CallingFirst(llm, engine), processor.tokenizer, [conversation], data, tools, 100, sampling)
    finally:
        shutdown_llm(llm)
    assert conversation.tool_calls[0]["ok"] and conversation.tool_calls[0]["result"] == "5"
    assert conversation.num_turns == 2
    expanded = processor(text=rendered.text, images=[shown], add_special_tokens=False)["input_ids"][0]
    assert conversation.prompt_ids == list(expanded)
    # The second turn: sampled after the tool's answer, with the picture in view.
    start, end = conversation.turn_spans[1]
    ids = torch.tensor([conversation.prompt_ids + conversation.response_ids[:end]])
    model = AutoModelForImageTextToText.from_pretrained(student, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(input_ids=ids, **processor.image_processor(images=[[shown]], return_tensors="pt")).logits[0].log_softmax(-1)
    at = len(conversation.prompt_ids) + start
    want = logp[at - 1 : ids.shape[1] - 1].gather(-1, ids[0, at:, None])[:, 0].numpy()
    np.testing.assert_allclose(conversation.sampler_logprobs[start:end], want, **model_logprob_tol(model))  # two float32 forwards


# -- slow: teachers of another tokenizer (score.cross_tokenizer) -------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("teacher", ["text", "vision"])
def test_a_teacher_of_another_tokenizer_reads_the_picture_or_its_caption(vision_round, vision_pair, other_tokenizer_teachers, tmp_path, teacher):
    """score.cross_tokenizer with images: a text-only teacher given the picture's answer as a caption
    (its context leaves the <image> placeholder out), and a VLM teacher of another tokenizer that reads
    the picture through its own processor. Every student character maps to one teacher character, so
    each aligned teacher log-prob equals a plain forward of the teacher over its own prompt and its
    own tokens of the response text; the student's closing end of utterance gets the teacher's own end
    of turn (or EOS) after the same text, and any other special token has no text and stays unaligned."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    from gndpo.apps.fork import fork_run
    from gndpo.pipeline.run.images import RunImages
    from gndpo.stages.text.chat import end_of_turn_ids, stop_token_ids

    path = other_tokenizer_teachers / teacher
    overrides = [f"teacher={path}", "score.cross_tokenizer=true"]
    if teacher == "text":
        overrides.append("teacher_context.messages=[{role: user, content: 'The picture shows {answer}. {prompt}'}]")
    fork = fork_run(str(vision_round), str(tmp_path / "fork"), 0, overrides)
    run_stages(tmp_path / "fork", "score")
    prompts = {p["prompt_id"]: p for p in fork.prompts("train")}
    pictures = RunImages(fork.fs)
    student_tok = AutoTokenizer.from_pretrained(vision_pair / "student")
    if teacher == "text":
        model, tok = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
        prompt_of = lambda row: (tok(f"The picture shows {prompts[row['prompt_id']]['answer']}. n?")["input_ids"], {})  # noqa: E731
    else:
        model, processor = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval(), AutoProcessor.from_pretrained(path)
        tok = processor.tokenizer
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]}], add_generation_prompt=True)

        def prompt_of(row):
            encoded = processor(text=text, images=pictures.of(prompts[row["prompt_id"]]), add_special_tokens=False, return_tensors="pt")
            return encoded.pop("input_ids")[0].tolist(), {k: v for k, v in encoded.items() if k != "attention_mask"}
    scored = {r["rollout_id"]: r for r in committed_rows(tmp_path / "fork", "score")}
    student_stops = stop_token_ids(student_tok, fork.cfg.data)
    teacher_end = (end_of_turn_ids(tok, fork.cfg.data) or [tok.eos_token_id])[0]
    checked = 0
    for row in committed_rows(vision_round):
        response = row["response_token_ids"]
        closes = response[-1] in student_stops
        teacher_ids = tok(student_tok.decode(response, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
        teacher_ids += [teacher_end] if closes else []
        prompt, pixels = prompt_of(row)
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([prompt + teacher_ids]), **pixels).logits[0].log_softmax(-1)
        want = logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(teacher_ids)[:, None])[:, 0].numpy()
        got = scored[row["rollout_id"]]
        has_text = [int(student_tok.decode([t], skip_special_tokens=True) != "") for t in response]
        assert got["aligned"] == has_text[:-1] + [1 if closes else has_text[-1]]
        np.testing.assert_allclose([v for v, a in zip(got["teacher_logprobs"], got["aligned"]) if a], want, **model_logprob_tol(model))
        checked += len(want)
    assert checked > 0  # random VLM students rarely close their turn: the end is checked where one did


@pytest.mark.slow
@pytest.mark.parametrize("freeze", [True, False])
def test_zero3_trains_a_vlm_as_zero0_does(vision_round, tmp_path, freeze):
    """Train under ZeRO-3 (parameters partitioned, the image tensors through the partitioned vision
    tower, the export gathered) on round 0's rows, re-scored in a fork: the same update as ZeRO-0's,
    with the vision tower frozen (the parent's update; the tower bit-identical to the start) and with
    the whole model trained (a ZeRO-0 fork of its own; the tower's update and the whole update agree).
    The second case scores in the process the first trained in (a ZeRO-3 engine once left transformers
    partitioning every later model load)."""
    from gndpo.apps.fork import fork_run
    from gndpo.pipeline.run.run import open_run

    trained = [] if freeze else ["model.freeze_vision=false"]
    fork = fork_run(str(vision_round), str(tmp_path / "fork"), 0, ["train.zero_stage=3", *trained])
    run_stages(tmp_path / "fork", "score", "normalize", "train")
    from transformers.integrations import is_deepspeed_zero3_enabled

    # Train ran in this process: a model loaded after it (score's, next round) must load whole.
    assert not is_deepspeed_zero3_enabled()
    reference = open_run(str(vision_round))
    if not freeze:
        reference = fork_run(str(vision_round), str(tmp_path / "zero0"), 0, trained)
        run_stages(tmp_path / "zero0", "score", "normalize", "train")
    start = load_file(Path(open_run(str(vision_round)).cfg.student) / "model.safetensors")
    zero0 = load_file(f"{reference.policy_path(1)}/model.safetensors")
    zero3 = load_file(f"{fork.policy_path(1)}/model.safetensors")
    assert zero3.keys() == zero0.keys()
    vision = [k for k in start if "vision_model" in k or "connector" in k]

    def agree(keys: list[str]) -> None:
        # Adam's first step moves each weight by about lr = 1e-2 (g / sqrt(v)), and where a gradient is
        # near Adam's eps reduction-order noise changes that weight's step (measured 1.5e-5 to 1.2e-4
        # on single weights between runs): the updates as a whole must agree to 0.1%.
        step0 = torch.cat([(zero0[k] - start[k]).flatten() for k in keys])
        step3 = torch.cat([(zero3[k] - start[k]).flatten() for k in keys])
        assert float(step0.norm()) > 0.1 and float((step3 - step0).norm() / step0.norm()) < 1e-3

    agree(list(zero0))
    if freeze:
        assert all(torch.equal(zero3[k], start[k]) for k in vision)
    else:
        agree(vision)
