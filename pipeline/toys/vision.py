"""A tiny vision-language model in the Idefics3 (SmolVLM) family, built offline: a Llama text model, a
SigLIP-style vision tower, the pixel-shuffle connector, and an ``Idefics3Processor`` over a character
tokenizer, saved as a Hugging Face folder that transformers and vLLM both load.

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

import string
from dataclasses import dataclass
from pathlib import Path

from gndpo.pipeline.toys.arithmetic import character_tokenizer

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
