"""The embedded vision default: bar charts whose two bars must be read and added, and a tiny
vision-language model in the Idefics3 (SmolVLM) family that learns it, built offline.

A prompt is one 64x64 picture of two bars (heights 0-9 units; positions, widths and colours vary) and
the text ``sum?``; the answer is the sum of the heights. The text is the same for every prompt, so a
prompt without its picture cannot be answered. The model is a Llama text model, a SigLIP-style vision
tower, the pixel-shuffle connector, and an ``Idefics3Processor`` over a character tokenizer, saved as a
Hugging Face folder that transformers and vLLM both load; one model is trained twice, like the text
toys: the student is the checkpoint of the first validation at or above ``student_target``, the
teacher continues until ``teacher_target``. Everything is built from a seed without a model hub and
cached under ``$GNDPO_CACHE`` (:mod:`gndpo.apps.demos.build`, pinned arithmetic).

The family's special tokens are the real ones (``<image>``, ``<fake_token_around_image>``,
``<global-img>``, ``<end_of_utterance>``), so what gndpo does with this model is what it does with
SmolVLM: each ``<image>`` in a rendered prompt expands, in the processor and in vLLM alike, to
``<fake_token_around_image><global-img>`` + ``image_seq_len`` x ``<image>`` + ``<fake_token_around_image>``
(18 tokens at 64x64 pixels, patch 8 and ``scale_factor`` 2). One image per picture, no splitting: the
image processor resizes to ``image_size`` pixels.

Without torchvision (this project's CPU installs) transformers uses its PIL image processor,
``Idefics3ImageProcessorPil``; on a GPU machine the torchvision one gives the same tensors.
"""

from __future__ import annotations

import io
import json
import random
import string
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gndpo.apps.demos.arithmetic import ModelSpec, character_tokenizer, padded_batch, spec_key, train_supervised
from gndpo.apps.demos.build import pinned_build, use_build_threads
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.settings.schema import DataConfig
from gndpo.stages.text.chat import render_prompt
from gndpo.storage.cache import cached_build

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>")
END_OF_UTTERANCE = "<end_of_utterance>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Renders string content and content-part lists ({"type": "image"} / {"type": "text", "text": ...}) alike.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class VisionModelSpec:
    """The shapes of the toy VLM. vLLM's CPU attention needs a head size of 32, 64, 80 or more."""

    hidden: int = 128
    layers: int = 2
    heads: int = 4
    intermediate: int = 256
    vision_hidden: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    image_size: int = 64
    patch_size: int = 8
    scale_factor: int = 2
    context: int = 256

    @property
    def image_seq_len(self) -> int:
        """``<image>`` tokens per picture: the patches, pixel-shuffled by ``scale_factor`` in each direction."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


def image_tokens(spec: VisionModelSpec) -> list[str]:
    """What one picture's ``<image>`` placeholder expands to, in the processor and in vLLM alike."""
    return ["<fake_token_around_image>", "<global-img>", *["<image>"] * spec.image_seq_len, "<fake_token_around_image>"]


def vision_tokenizer(context: int):
    """A character tokenizer over printable ASCII with the Idefics3 image tokens, role markers and the
    end-of-utterance token, and a chat template that renders image parts."""
    tok = character_tokenizer(string.printable[:95], model_max_length=context)
    tok.add_special_tokens({"additional_special_tokens": [*IMAGE_TOKENS, END_OF_UTTERANCE, *ROLE_TOKENS]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def new_vision_model(spec: VisionModelSpec, tok, seed: int):
    """An ``Idefics3ForConditionalGeneration`` with ``spec``'s shapes and seeded random weights."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.heads, max_position_embeddings=spec.context,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    vision = Idefics3VisionConfig(
        hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden, num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads, image_size=spec.image_size, patch_size=spec.patch_size,
    )
    config = Idefics3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=spec.scale_factor,
        image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Idefics3ForConditionalGeneration(config)


def vision_processor(spec: VisionModelSpec, tok):
    """The family's processor at ``spec``'s image size, without image splitting."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    edge = {"longest_edge": spec.image_size}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=edge, max_image_size=edge)
    return Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=spec.image_seq_len, chat_template=CHAT_TEMPLATE)


def save_vision_model(model, processor, folder: str | Path) -> Path:
    """Write the model and its processor (tokenizer, image processor, chat template) to ``folder``."""
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    return folder


def build_random_vision_pair(folder: str | Path, spec: VisionModelSpec = VisionModelSpec(), teacher_layers: int = 3) -> Path:
    """``student/`` and ``teacher/`` under ``folder``: the same tokenizer and processor, random weights
    (the teacher deeper, seeded differently). Deterministic for a given spec."""
    folder = Path(folder)
    tok = vision_tokenizer(spec.context)
    processor = vision_processor(spec, tok)
    for name, layers, seed in (("student", spec.layers, 0), ("teacher", teacher_layers, 1)):
        shaped = VisionModelSpec(**{**spec.__dict__, "layers": layers})
        save_vision_model(new_vision_model(shaped, tok, seed), processor, folder / name)
    return folder


# -- the task ---------------------------------------------------------------------------------------
QUESTION = "<image>sum?"
BAR_COLOURS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (0, 0, 0))


@dataclass(frozen=True)
class VisionToySpec:
    """Everything that determines the built files; its hash names the cache folder."""

    n_train_prompts: int = 4096
    n_heldout: int = 500
    seed: int = 11
    shapes: VisionModelSpec = field(default_factory=VisionModelSpec)
    training: ModelSpec = field(default_factory=lambda: ModelSpec(layers=2, hidden=128, heads=4, max_steps=2500, lr=3e-3, batch=64))
    student_target: float = 0.15
    teacher_target: float = 0.92
    assets_version: int = 1

    def key(self) -> str:
        return spec_key(self)


def bar_chart(a: int, b: int, rng: random.Random, size: int = 64) -> bytes:
    """A PNG of two bars ``a`` and ``b`` units high (a unit is 5 pixels), at jittered places and widths,
    in one of a few colours, on white."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(im)
    colour = rng.choice(BAR_COLOURS)
    base = size - 6
    draw.line([(2, base + 1), (size - 3, base + 1)], fill=(128, 128, 128))  # the axis: height 0 is visible too
    for value, left in ((a, 6 + rng.randint(0, 6)), (b, size // 2 + 2 + rng.randint(0, 6))):
        width = rng.randint(12, 18)
        draw.rectangle([left, base - 5 * value, left + width, base], fill=colour)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def task_rows(rng: random.Random, n: int, folder: Path, prefix: str, seen: set) -> list[dict]:
    """``n`` prompts, each with its chart written as ``folder/images/<prefix><i>.png``; no picture
    twice (``seen``: the charts drawn so far, shared across splits, so no held-out chart is trained on)."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    while len(rows) < n:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        chart = bar_chart(a, b, rng)
        if chart in seen:
            continue
        seen.add(chart)
        name = f"images/{prefix}{len(rows):05d}.png"
        (folder / name).write_bytes(chart)
        rows.append({"prompt": QUESTION, "answer": str(a + b), "images": [name]})
    return rows


# -- training -----------------------------------------------------------------------------------------


class Charts:
    """Token sequences, loss masks and image tensors of answered prompts, rendered as rollout renders
    them (:func:`render_prompt`, the processor's expansion), so training sees what the student will.
    The image tensors of ``rows`` (pictures under ``folder``) are computed once."""

    def __init__(self, processor, folder: Path, rows: list[dict]):
        import torch
        from PIL import Image

        tok = processor.tokenizer
        text = render_prompt(tok, {"prompt": QUESTION, "images": '["x"]'}, DataConfig()).text
        blank = Image.new("RGB", (64, 64), "white")
        # Every prompt reads the same text with one picture: its expanded ids are the same for all.
        prompt = list(processor(text=text, images=[blank], add_special_tokens=False)["input_ids"][0])
        end = tok.convert_tokens_to_ids(END_OF_UTTERANCE)
        seqs = [prompt + list(tok(r["answer"], add_special_tokens=False)["input_ids"]) + [end] for r in rows]
        self.ids, self.mask = padded_batch(seqs, [[0] * len(prompt) + [1] * (len(s) - len(prompt)) for s in seqs], tok.pad_token_id)
        chunks = [processor.image_processor(images=[[Image.open(folder / r["images"][0]).convert("RGB")] for r in rows[i : i + 256]],
                                            return_tensors="pt") for i in range(0, len(rows), 256)]
        self.images = {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}

    def batch(self, index: list[int]):
        """(ids, loss mask, image tensors) of the rows at ``index``."""
        return self.ids[index], self.mask[index], {k: v[index] for k, v in self.images.items()}

    def greedy_accuracy(self, model) -> float:
        """Greedy exact match computed exactly by teacher forcing: greedy decoding writes the answer and
        the end of the turn iff each is the argmax at its position."""
        import torch

        right, n = 0, len(self.ids)
        with torch.no_grad():
            for start in range(0, n, 256):
                ids, mask, images = self.batch(list(range(start, min(start + 256, n))))
                logits = model(input_ids=ids, **images).logits[:, :-1]
                hit = (logits.argmax(-1) == ids[:, 1:]) | (mask[:, 1:] == 0)
                right += int(hit.all(-1).sum())
        return right / n


def ensure_vision_toy_assets(spec: VisionToySpec = VisionToySpec(), log=info) -> Path:
    """Return the folder with the built vision toy, building it first if it is not cached."""
    return cached_build(f"toy-vision-{spec.key()}", pinned_build(build_vision_toy, spec, log=log))


def build_vision_toy(spec: VisionToySpec, out: Path, log=info) -> dict:
    import torch

    use_build_threads()
    rng, seen = random.Random(spec.seed), set()
    heldout = task_rows(rng, spec.n_heldout, out, "heldout-", seen)
    train = task_rows(rng, spec.n_train_prompts, out, "train-", seen)
    validation = task_rows(random.Random(f"val:{spec.seed}"), 256, out / "validation", "val-", seen)
    for name, rows in (("train", train), ("heldout", heldout)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = vision_tokenizer(spec.shapes.context)
    processor = vision_processor(spec.shapes, tok)
    charts = {name: Charts(processor, folder, rows) for name, folder, rows in
              (("train", out, train), ("heldout", out, heldout), ("validation", out / "validation", validation))}
    model = new_vision_model(spec.shapes, tok, spec.seed)
    info = {"spec": asdict(spec), "key": spec.key()}

    def next_batch(batch_rng):
        return charts["train"].batch(batch_rng.sample(range(len(train)), spec.training.batch))

    def save(role: str, step: int, _validation: float) -> None:
        acc = charts["heldout"].greedy_accuracy(model)
        log(f"  {role}: held-out greedy exact match {acc:.3f} after {step} steps")
        info.update({f"{role}_heldout_accuracy": acc, f"{role}_steps": step})
        save_vision_model(model, processor, out / role)

    log(f"building the vision toy: {spec.shapes.layers} layers x {spec.shapes.hidden} wide, at most {spec.training.max_steps} steps")
    milestones = [("student", spec.student_target, spec.training.max_steps), ("teacher", spec.teacher_target, spec.training.max_steps)]
    torch.manual_seed(spec.seed)
    train_supervised(model, spec.training, spec.seed, next_batch, lambda _milestone: charts["validation"].greedy_accuracy(model), milestones, save, log=log)
    info["parameters"] = sum(p.numel() for p in model.parameters())
    (out / "info.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    return info
