"""A tiny GGUF file for the tests of `gndpo convert` that are about the command, not a real model."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_gguf(path: Path, hidden: int = 64, heads: int = 4, kv_heads: int = 2, ff: int = 128) -> Path:
    """A llama GGUF shaped like the packaged SmolLM2 file, in about 0.1 MB: a byte-level BPE tokenizer
    (three ChatML special tokens, the 256 byte characters, two merges: 261 tokens), one layer of hidden
    size 64 whose matrices are Q8_0-quantized (so transformers really dequantizes), tied embeddings (no
    ``output.weight``), BOS/EOS/pad ids and a ChatML chat template. Random weights from a fixed seed."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = special + list(bytes_to_unicode().values()) + ["Ġt", "he"]
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(special) + [gguf.TokenType.NORMAL] * (len(tokens) - len(special)))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(0)

    def weight(*shape):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    w.add_tensor("token_embd.weight", weight(len(tokens), hidden))  # also the output layer: tied
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    kv = hidden // heads * kv_heads
    matrices = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, hidden),
                "ffn_gate": (ff, hidden), "ffn_up": (ff, hidden), "ffn_down": (hidden, ff)}
    for name, shape in matrices.items():
        q8 = gguf.quants.quantize(weight(*shape), gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.0.{name}.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
