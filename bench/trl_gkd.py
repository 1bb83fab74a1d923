"""One on-policy distillation round in TRL, the peer gndpo is measured against (run as its own process).

TRL 1.16's GKDTrainer with ``lmbda=1`` (every batch is sampled from the student) and ``beta=1`` (reverse
KL(student || teacher), the objective of gndpo's ``reverse_kl`` method), temperature 1, fp32 on CPU
(gradient checkpointing and bf16 off), a constant learning rate, AdamW. Each prompt appears ``--n`` times
in the dataset, so ``--steps`` optimizer steps of ``--batch`` sequences see the same prompts x samples as
one gndpo round. The trained student is saved to ``--out`` for ``gndpo eval``.

The prompts: GKD's chat collator renders each row's ``messages`` without the last (assistant) turn
through the tokenizer's chat template and finds the prompt/completion boundary by byte offsets in the
full conversation; gndpo renders the same turns with ``add_generation_prompt`` and tokenizes the text
without adding special tokens (templates such as SmolLM2's ChatML write their own). The placeholder
assistant turn only serves the collator (on-policy generation replaces it). With ``--check-prompts``,
each prompt goes through the trainer's collator before training and its prompt ids are compared with
gndpo's rendering; the count that agree is reported (``prompts_match_gndpo``), so a template where the
two differ shows up (a few milliseconds a prompt, inside the timed process).

Prints one JSON line: wall seconds inside ``train()``, and the process's own start-up (imports, models).
"""

from __future__ import annotations

import argparse
import json
import random
import time

T_START = time.time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--student", required=True)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--prompts", required=True, help="jsonl with prompt and answer")
    ap.add_argument("--count", type=int, required=True, help="prompts used (the first, in a seeded order)")
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True, help="sequences per optimizer step")
    ap.add_argument("--micro", type=int, required=True, help="sequences per forward/backward")
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--check-prompts", action="store_true", help="compare the collator's prompt ids with gndpo's")
    a = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    torch.manual_seed(0)
    rows = [json.loads(line) for line in open(a.prompts)]
    random.Random(0).shuffle(rows)
    rows = rows[: a.count]
    data = Dataset.from_list([
        {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"] or "."}]}
        for r in rows for _ in range(a.n)
    ])
    tok = AutoTokenizer.from_pretrained(a.student)
    student = AutoModelForCausalLM.from_pretrained(a.student, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher, dtype=torch.float32)
    args = GKDConfig(
        output_dir=a.out, per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.batch // a.micro,
        max_steps=a.steps, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, lmbda=1.0, beta=1.0, temperature=1.0, max_new_tokens=a.max_new_tokens,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, report_to=[], logging_steps=10**6,
        save_strategy="no", seed=0, disable_dropout=True, max_length=1024, dataloader_num_workers=0,
    )
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=data, processing_class=tok)
    checked = {}
    if a.check_prompts:
        match = 0
        for row in data.select(range(0, len(data), a.n)):  # each prompt once
            text = tok.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
            collated = trainer.data_collator([row])
            ids = collated["prompts"][0][collated["prompt_attention_mask"][0].bool()].tolist()
            match += ids == list(tok(text, add_special_tokens=False)["input_ids"])
        checked = {"prompts_match_gndpo": f"{match} of {len(rows)}"}
    ready = time.time()
    trainer.train()
    trained = time.time()
    trainer.save_model(a.out)
    tok.save_pretrained(a.out)
    print(json.dumps({"startup_s": round(ready - T_START, 2), "train_s": round(trained - ready, 2),
                      "sequences": a.steps * a.batch, **checked}))


if __name__ == "__main__":
    main()
