"""Train's step at a 262,144-token vocabulary: the output layer's gradient computed in the forward pass
(``train.fused_output``, the default) against the checkpointed path (each chunk's logits recomputed in
backward), on the same rows, in the same run.

The model has Gemma 3 270M's shape with random weights (a Llama block with its sizes: vocabulary 262,144,
hidden 640, 18 layers, 4 heads of 256 with one key-value head, MLP 2,048, tied embeddings: 268M
parameters, 168M of them the embedding the output layer shares). The rows are the issue's job: 8 prompts
x 4 samples with responses of 24 and of 384 tokens (random ids, prompts of 40), train's loss is forward
KL on the teacher's top-16 (the methods guide's advice), float32 on the CPU. One step is train's own
micro-batch loss (``Objective.micro_batch_loss``, micro-batches as ``train.max_tokens_per_batch`` cuts
them), its backward and an AdamW step, set up as train's engine sets them up (torch's fused AdamW; with
the fused path the tied embedding's lookup gradient sparse). Each (length, path) runs in a fresh
process, which times two steps (the first also allocates AdamW's state) and reports its peak resident
set; the paths alternate.

    python bench/output_layer.py            # writes results/output_layer.{json,md}
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, machine, save_json  # noqa: E402

CACHE = Path.home() / ".cache" / "gndpo" / "bench" / "gemma3-270m-shape"
PROMPTS, SAMPLES, PROMPT_TOKENS, TOPK = 8, 4, 40, 16
LENGTHS = (24, 384)
PATHS = ("checkpointed", "fused")


def gemma3_270m_shape():
    """A Llama of Gemma 3 270M's sizes, random weights (seeded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, max_position_embeddings=2048, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def model_folder() -> Path:
    if not (CACHE / "config.json").exists():
        gemma3_270m_shape().save_pretrained(CACHE, safe_serialization=True)
    return CACHE


def rows(length: int):
    """The round's responses as train rows, seeded: random prompts and responses, a teacher's top-16."""
    import numpy as np

    from gndpo.stages.training.batch import TrainRow

    rng = np.random.default_rng(length)
    out = []
    for p in range(PROMPTS):
        prompt = rng.integers(2, 32_000, PROMPT_TOKENS)
        for s in range(SAMPLES):
            top = np.sort(rng.dirichlet(np.ones(TOPK + 1) * 0.5, length), axis=-1)[:, ::-1]
            out.append(TrainRow(
                rollout_id=f"{p}-{s}", prompt=prompt, response=rng.integers(2, 32_000, length), old_logp=np.full(length, -12.0, np.float32),
                adv=np.zeros(length, np.float32), pg_mask=np.zeros(length, np.float32), div=np.ones(length, np.float32),
                mask=np.ones(length, np.float32), weight=1.0, topk_ids=rng.integers(2, 262_144, (length, TOPK)).astype(np.int32),
                topk_logp=np.log(top[:, :TOPK]).astype(np.float32), topk_rest=np.log(top[:, TOPK]).astype(np.float32), prompt_id=str(p),
            ))
    return out


def one(path: str, length: int) -> dict:
    """Two train steps on the rows in this process; the second's seconds, and the process's peak memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from gndpo.pipeline.config.load import config_from_dict
    from gndpo.stages.models.batches import token_budget_batches
    from gndpo.stages.models.device import set_cpu_threads
    from gndpo.stages.models.fused_output import sparse_tied_lookup
    from gndpo.stages.models.logprobs import logits_chunk
    from gndpo.stages.training.objective import Objective

    set_cpu_threads()
    folder = str(model_folder())
    cfg = config_from_dict({"student": folder, "teacher": folder, "data": {"train": "unused.jsonl"}, "method": {"name": "forward_kl"},
                            "score": {"teacher_topk": TOPK}, "train": {"fused_output": path == "fused"}})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    if path == "fused":
        sparse_tied_lookup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    objective = Objective.of(cfg, 0, 0, torch.device("cpu"), fusable=True)
    assert objective.fused == (path == "fused")
    data = rows(length)
    micros = token_budget_batches([r.tokens for r in data], cfg.train.max_tokens_per_batch, cfg.train.micro_batch_size)
    n_tokens = sum(len(r.response) for r in data)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for micro in micros:
            loss, _ = objective.micro_batch_loss(model, [data[i] for i in micro], 0, len(data), n_tokens, float(len(data)))
            loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"path": path, "response_tokens": length, "tokens": n_tokens, "micro_batches": len(micros), "chunk": logits_chunk(model, cfg.model),
            "seconds": round(seconds[1], 2), "first_step_s": round(seconds[0], 2), "tokens_per_s": round(n_tokens / seconds[1], 1),
            "peak_gib": round(peak / 2**30, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, metavar=("PATH", "LENGTH"), help="(internal) one measurement in this process")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--table", action="store_true", help="only rewrite results/output_layer.md from the saved measurements")
    a = ap.parse_args()
    if a.table:
        write_table(json.loads((RESULTS / "output_layer.json").read_text()))
        return
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]))))
        return
    model_folder()
    measured = []
    for length in map(int, a.lengths.split(",")):
        for path in PATHS:
            out = subprocess.run([sys.executable, __file__, "--one", path, str(length)], capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{path} at {length} tokens failed:\n{out.stderr[-3000:]}")
            measured.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(measured[-1], flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "measured": measured}
    save_json(RESULTS / "output_layer.json", result)
    write_table(result)


def write_table(result: dict) -> None:
    """results/output_layer.md from the measurements: both steps of each process (the first includes
    the optimizer's state allocation), and the ratios of the second."""
    measured = result["measured"]
    lines = [f"# Train's step at a 262,144-token vocabulary ({result['date']}, {result['machine']})", "",
             "Gemma 3 270M's shape (random weights, tied embeddings), 8 prompts x 4 samples, forward KL on the teacher's top-16,",
             "float32; one step = micro-batch losses, backward and AdamW, two steps in a fresh process per row.", "",
             "| response tokens | path | chunk | first step s | second step s | tokens/s (second) | peak GiB "
             "| speed vs checkpointed (first / second) | memory vs checkpointed |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in measured:
        base = next(b for b in measured if b["response_tokens"] == m["response_tokens"] and b["path"] == "checkpointed")
        lines.append(f"| {m['response_tokens']} | {m['path']} | {m['chunk']} | {m['first_step_s']} | {m['seconds']} | {m['tokens_per_s']} | "
                     f"{m['peak_gib']} | {base['first_step_s'] / m['first_step_s']:.2f}x / {base['seconds'] / m['seconds']:.2f}x | "
                     f"{m['peak_gib'] / base['peak_gib']:.2f}x |")
    (RESULTS / "output_layer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
