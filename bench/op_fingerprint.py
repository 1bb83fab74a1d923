"""Which float operation makes two CPU types build different toys? Fingerprints, kept across sessions.

The pinned toy build (torch's portable kernels, MKL's compatible branch, 2 threads) gives the same bytes
on two AMD EPYCs (one AVX2, one AVX-512) and other bytes on an Intel Xeon, and no session has had both
vendors at once to find the first operation that differs. This script records, under the build's own
pinned arithmetic, the sha256 of every operation the toy's training uses (matrix products of its
shapes, the vector math, the reductions, a loss and its gradient, an AdamW step) and of the first
training steps of the toy model itself, on inputs that are exact on every machine (small integers
over powers of two, so no random-number kernel is involved). Each CPU type adds its column to
results/op_fingerprint.{json,md}; the table marks the operations whose bytes differ between columns.

    .venv/bin/python bench/op_fingerprint.py
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, save_json  # noqa: E402

from gndpo.apps.demos.arithmetic import ModelSpec, new_model  # noqa: E402
from gndpo.apps.demos.build import pinned_build, use_build_threads  # noqa: E402

OUT = RESULTS / "op_fingerprint.json"
TRAIN_STEPS = 40  # the toy's weights are hashed after each of its first training steps


def digest(tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()[:12]


def exact(gen, *shape):
    """Float32 values k / 1024 with |k| <= 4096: exact on every machine, no random-number kernel."""
    import torch

    return torch.randint(-4096, 4097, shape, generator=gen).float() / 1024


def operation_fingerprints(folder: Path, log=print) -> dict:
    """Run in the pinned build process: op name -> sha256 prefix of its result."""
    import torch
    import torch.nn.functional as F

    use_build_threads()
    gen = torch.Generator().manual_seed(0)
    x, w, w_up = exact(gen, 256, 128), exact(gen, 128, 128) / 16, exact(gen, 512, 128) / 16
    q, k = exact(gen, 16, 4, 12, 32), exact(gen, 16, 4, 12, 32)
    logits, labels = exact(gen, 256, 16) * 4, torch.randint(0, 16, (256,), generator=gen)
    out = {"inputs": digest(torch.cat([x.flatten(), w.flatten(), q.flatten(), logits.flatten()]))}
    out["matmul 256x128 @ 128x128"] = digest(x @ w.T)
    out["matmul 256x128 @ 128x512"] = digest(x @ w_up.T)
    out["matmul, the weight's gradient (128x256 @ 256x512)"] = digest(x.T @ (x @ w_up.T))
    out["linear (addmm, bias)"] = digest(F.linear(x, w, w[0]))
    out["bmm attention scores"] = digest(q @ k.transpose(-1, -2))
    out["scaled_dot_product_attention"] = digest(F.scaled_dot_product_attention(q, k, k, is_causal=True))
    small = x / 8
    for name, fn in {"exp": torch.exp, "log": lambda t: torch.log(t.abs() + 1), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
                     "silu": F.silu, "rsqrt": lambda t: torch.rsqrt(t.abs() + 1), "pow 2": lambda t: t.pow(2),
                     "cos": torch.cos, "sin": torch.sin}.items():
        out[name] = digest(fn(small))
    out["sum"], out["mean over rows"] = digest(x.sum()), digest(x.mean(-1))
    out["softmax"], out["log_softmax"] = digest(torch.softmax(logits, -1)), digest(torch.log_softmax(logits, -1))
    leaf = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(leaf, labels)
    loss.backward()
    out["cross_entropy"], out["cross_entropy gradient"] = digest(loss), digest(leaf.grad)
    param = torch.nn.Parameter(w.clone())
    param.grad = w_up[:128] / 4
    torch.optim.AdamW([param], lr=3e-3, betas=(0.9, 0.98), weight_decay=0.0).step()
    out["AdamW step"] = digest(param)
    out.update(toy_training_fingerprints(gen))
    return out


def toy_training_fingerprints(gen) -> dict:
    """The toy's own model (2 layers, 128 wide) from exact weights, trained on a fixed batch: the hash of
    its loss and weights after each of the first TRAIN_STEPS steps (where the two vendors part)."""
    import torch

    model = new_model(ModelSpec(layers=2, hidden=128, heads=4, max_steps=0, lr=3e-3), vocab_size=16, context=32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(exact(gen, *p.shape) / 64)
    ids = torch.randint(0, 16, (64, 16), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, betas=(0.9, 0.98))
    out = {}
    for step in range(1, TRAIN_STEPS + 1):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        out[f"toy step {step:02d}: loss, weights"] = f"{digest(loss)} {digest(weights)}"
    return out


def markdown(table: dict) -> str:
    cpus = list(table)
    ops = list(dict.fromkeys(op for cpu in cpus for op in table[cpu]))
    lines = [f"Pinned arithmetic, {len(cpus)} CPU type(s). An operation is marked where its bytes differ between CPU types.", "",
             "| operation | " + " | ".join(cpus) + " | same on all |", "|---" * (len(cpus) + 2) + "|"]
    for op in ops:
        values = [table[cpu].get(op, "-") for cpu in cpus]
        same = "yes" if len(set(values)) == 1 else "**no**"
        lines.append(f"| {op} | " + " | ".join(f"`{v}`" for v in values) + f" | {same} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fingerprints = pinned_build(operation_fingerprints, log=print)(Path(tmp))
    table = json.loads(OUT.read_text()) if OUT.exists() else {}
    table[machine()] = fingerprints
    save_json(OUT, table)
    (RESULTS / "op_fingerprint.md").write_text(markdown(table))
    print(markdown(table))


if __name__ == "__main__":
    main()
