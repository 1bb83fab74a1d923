"""The embedded default: a verifiable addition task, a character tokenizer, and a teacher/student pair.

Nothing here touches a model hub. :func:`ensure_toy_assets` builds, deterministically from a seed on a
given CPU type (its arithmetic pinned by :func:`gndpo.apps.demos.build.pinned_build`), and caches
under ``$GNDPO_CACHE`` (default ``~/.cache/gndpo``):

* ``tokenizer`` files (character-level WordLevel, saved with ``save_pretrained``) shared by both models,
* ``teacher/`` and ``student/``: Llama models in Hugging Face format that vLLM and transformers both load,
* ``train.jsonl`` / ``heldout.jsonl``: prompts with their exact answers, disjoint by construction,
* ``info.json``: the build spec and the held-out exact-match of both models (greedy).

The task is ``a+b=`` with the sum written least-significant digit first ("reversed"), the format under
which a small transformer learns addition fastest: each output digit then depends only on digits already
seen and one carry. The student is a smaller model trained for fewer steps, so it is clearly weaker but
has the capacity to learn from the teacher.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gndpo.apps.demos.build import pinned_build, use_build_threads
from gndpo.pipeline.observe.logs import info
from gndpo.storage.cache import cached_build

SPECIAL = {"pad": "<pad>", "bos": "<s>", "eos": "</s>"}
CHARS = list("0123456789+=")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a toy model and how it is trained (steps, learning rate, batch)."""

    layers: int
    hidden: int
    heads: int
    max_steps: int
    lr: float
    batch: int = 128


@dataclass(frozen=True)
class ToySpec:
    """Everything that determines the built files; its hash names the cache folder."""

    digits: int = 3
    n_train_prompts: int = 4096
    n_heldout: int = 500
    seed: int = 1234
    # Measured here (2 CPU cores): ~0.08 s/step; with this seed the carry is learnt between steps 200
    # and 800 (other seeds sit longer on the first plateau). One training run yields both models: the student is the checkpoint saved
    # the first time validation exact match passes ``student_target`` (clearly weaker, but with the
    # capacity to learn the rest from the teacher), the teacher the one that passes ``teacher_target``.
    model: ModelSpec = field(default_factory=lambda: ModelSpec(layers=2, hidden=128, heads=4, max_steps=4000, lr=3e-3))
    student_target: float = 0.15
    teacher_target: float = 0.97
    # A third checkpoint of the same run between the two, kept where it comes before the teacher's: a
    # model reinforcement learning can still improve (the sparse-to-dense recipe's teacher on the toy).
    mid_target: float = 0.6
    student_max_steps: int | None = None  # save the student here at the latest (tests use tiny models)
    # bumped when the built files change for a given spec (2: BOS in the template; 3: pinned arithmetic)
    assets_version: int = 3

    def key(self) -> str:
        return spec_key(self)


def spec_key(spec) -> str:
    """The name of a toy's cache folder: a hash of every field of its spec (a dataclass)."""
    return hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]


# -- the task ---------------------------------------------------------------------------------------


def prompt_text(a: int, b: int, digits: int) -> str:
    """``a+b=`` with both operands zero-padded to ``digits`` and written least significant digit first,
    like the answer: digit i of the answer is then at a fixed distance from digits i of a and b."""
    return f"{str(a).zfill(digits)[::-1]}+{str(b).zfill(digits)[::-1]}="


def answer_text(a: int, b: int, digits: int) -> str:
    """The exact completion: the ``digits + 1`` digits of the sum, least significant first."""
    return str(a + b).zfill(digits + 1)[::-1]


def is_heldout(a: int, b: int, seed: int) -> bool:
    """A fixed 1/16 of all pairs is held out; training never samples from it."""
    return hashlib.sha1(f"{seed}:{a}+{b}".encode()).digest()[0] < 16


def sample_pairs(rng: random.Random, n: int, digits: int, seed: int, heldout: bool) -> list[tuple[int, int]]:
    hi = 10**digits - 1
    out, seen = [], set()
    while len(out) < n:
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        if is_heldout(a, b, seed) == heldout and (a, b) not in seen:
            seen.add((a, b))
            out.append((a, b))
    return out


def toy_rows(pairs: list[tuple[int, int]], digits: int) -> list[dict]:
    return [{"prompt": prompt_text(a, b, digits), "answer": answer_text(a, b, digits)} for a, b in pairs]


# -- tokenizer and models ---------------------------------------------------------------------------


def character_tokenizer(chars, model_max_length: int):
    """A fast tokenizer with one token per character of ``chars`` after <pad>, <s> and </s>, that
    prepends <s>; loads in vLLM and transformers. The toys' tokenizers are this plus their own tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {SPECIAL["pad"]: 0, SPECIAL["bos"]: 1, SPECIAL["eos"]: 2}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL["pad"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(""), "isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIAL['bos']} $A", special_tokens=[(SPECIAL["bos"], 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"], pad_token=SPECIAL["pad"], model_max_length=model_max_length,
    )


def build_tokenizer():
    """The arithmetic toy's tokenizer: its twelve characters."""
    fast = character_tokenizer(CHARS, model_max_length=64)
    # A template that renders a one-turn prompt as <s> + its text: exactly the ids the plain path gives,
    # so the toy runs through the chat path unchanged.
    fast.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return fast


def new_model(spec: ModelSpec, vocab_size: int, context: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=4 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def _encode_batch(tok, rows: list[dict]):
    """Left-aligned padded ids, and a mask selecting the answer tokens and the final </s>."""
    seqs, masks = [], []
    for r in rows:
        p = tok(r["prompt"])["input_ids"]
        a = tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    return padded_batch(seqs, masks, tok.pad_token_id)


def train_supervised(model, spec: ModelSpec, seed: int, next_batch, validate, milestones: list, on_milestone, log=info) -> int:
    """Next-token training with AdamW at a constant LR after warm-up, on the masked tokens of
    ``next_batch(rng) -> (ids, mask)``, or with a vision toy ``(ids, mask, image tensors)`` (freshly sampled, never held-out problems). ``milestones`` is a
    list of (name, target, step cap): each is reached the first time ``validate(name)`` (checked every
    10 steps; each milestone may measure something else) passes its target, or at its step cap, and
    ``on_milestone(name, step, accuracy)`` is called
    then. Training stops after the last one (or at ``spec.max_steps``, which reaches all remaining).
    Returns the number of steps taken.

    Small transformers learn these tasks abruptly (validation accuracy jumps from ~5% to ~60% within 50
    steps, at a step that depends on the seed), so milestones on measured accuracy, not fixed step
    counts, are what make the teacher reliably strong and the student reliably weak.
    """
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0, betas=(0.9, 0.98))
    pending = list(milestones)
    acc, step = 0.0, 0
    for step in range(1, spec.max_steps + 1):
        for g in opt.param_groups:
            g["lr"] = spec.lr * min(1.0, step / 100)
        ids, mask, *inputs = next_batch(rng)  # a vision toy's batch adds its image tensors
        model.train()
        logits = model(input_ids=ids, **(inputs[0] if inputs else {})).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.eval()
        if step % 10 == 0:
            acc = validate(pending[0][0])
            if step % 200 == 0:
                log(f"  step {step:5d}  loss {loss.item():.4f}  validation exact match {acc:.3f}")
        while pending and (
            (step % 10 == 0 and acc >= pending[0][1]) or step >= pending[0][2] or step == spec.max_steps
        ):
            name = pending.pop(0)[0]
            log(f"  step {step:5d}: {name} checkpoint (validation exact match {acc:.3f})")
            on_milestone(name, step, acc)
            if pending and step % 10 == 0:
                acc = validate(pending[0][0])  # the next milestone may measure something else
        if not pending:
            break
    return step


def padded_batch(seqs: list[list[int]], masks: list[list[int]], pad_id: int):
    """Left-aligned ``[B, T]`` ids padded with ``pad_id``, and the float loss mask beside them."""
    import torch

    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def greedy_accuracy(model, tok, rows: list[dict], max_new_tokens: int = 8) -> float:
    """Held-out exact match with greedy decoding in plain torch (used only while building)."""
    import torch

    correct = 0
    with torch.no_grad():
        for start in range(0, len(rows), 256):
            chunk = rows[start : start + 256]
            prompts = [tok(r["prompt"])["input_ids"] for r in chunk]
            width = max(map(len, prompts))
            # Right-align prompts so every row continues from the same position.
            ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p)
                attn[i, width - len(p) :] = 1
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
            texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
            correct += sum(t.strip() == r["answer"] for t, r in zip(texts, chunk))
    return correct / len(rows)


# -- building and caching ---------------------------------------------------------------------------


def ensure_toy_assets(spec: ToySpec = ToySpec(), log=info) -> Path:
    """Return the folder with the built toy assets, building it first if it is not cached."""
    return cached_build(f"toy-{spec.key()}", pinned_build(build_toy_assets, spec, log=log))


def build_toy_assets(spec: ToySpec, out: Path, log=info) -> dict:
    use_build_threads()
    tok = build_tokenizer()
    rng = random.Random(spec.seed)
    heldout = toy_rows(sample_pairs(rng, spec.n_heldout, spec.digits, spec.seed, heldout=True), spec.digits)
    train = toy_rows(sample_pairs(rng, spec.n_train_prompts, spec.digits, spec.seed, heldout=False), spec.digits)
    for name, rows in (("train", train), ("heldout", heldout)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    info = {"spec": asdict(spec), "key": spec.key()}
    milestones = [
        ("student", spec.student_target, spec.student_max_steps or spec.model.max_steps),
        *([("mid", spec.mid_target, spec.model.max_steps)] if spec.student_target < spec.mid_target < spec.teacher_target else []),
        ("teacher", spec.teacher_target, spec.model.max_steps),
    ]
    info.update(train_toy_models(spec, tok, milestones, heldout, out, log=log))
    (out / "info.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    return info


def train_toy_models(spec: ToySpec, tok, milestones: list, heldout: list[dict], out: Path, log=info, model=None) -> dict:
    """Train one model of ``spec.model`` (or ``model``, from where it is) on the task with tokenizer
    ``tok`` and save it (with ``tok``) as ``out/<role>`` at each milestone (see :func:`train_supervised`);
    returns each role's held-out exact match and step, and the parameter count."""
    import torch

    m = spec.model
    log(f"building toy models: {m.layers} layers x {m.hidden} wide, at most {m.max_steps} steps")
    torch.manual_seed(spec.seed)
    model = model if model is not None else new_model(m, vocab_size=len(tok))
    info = {}

    def save(role: str, step: int, _validation: float) -> None:
        acc = greedy_accuracy(model, tok, heldout)
        log(f"  {role}: held-out exact match {acc:.3f} after {step} steps")
        info.update({f"{role}_heldout_accuracy": acc, f"{role}_steps": step})
        model.save_pretrained(out / role, safe_serialization=True)
        tok.save_pretrained(out / role)

    # Validation problems come from the training bucket (never the held-out one) with their own rng.
    validation = toy_rows(sample_pairs(random.Random(f"val:{spec.seed}"), 256, spec.digits, spec.seed, heldout=False), spec.digits)

    def next_batch(rng):
        return _encode_batch(tok, toy_rows(sample_pairs(rng, m.batch, spec.digits, spec.seed, heldout=False), spec.digits))

    train_supervised(model, m, spec.seed, next_batch, lambda _milestone: greedy_accuracy(model, tok, validation), milestones, save, log=log)
    info["parameters"] = sum(p.numel() for p in model.parameters())
    return info


# -- the cross-tokenizer variant --------------------------------------------------------------------
def build_pair_tokenizer():
    """The toy tokenizer plus ten tokens that merge a doubled digit ("00" ... "99"): the same text cut
    differently wherever a digit repeats."""
    tok = build_tokenizer()
    tok.add_tokens([d + d for d in "0123456789"])
    return tok


def ensure_cross_tokenizer_assets(spec: ToySpec = ToySpec(), log=info) -> Path:
    """The toy with a teacher that has its own tokenizer (:func:`build_pair_tokenizer`): the toy's
    teacher with ten new embedding rows, trained on with the new tokenizer until it passes the teacher
    target again (from scratch, the merged digits make the carry much slower to learn: 0.14 after 2400
    steps where the toy's tokenizer passes 0.97 by step 800). The student and prompts are the toy's."""
    base = ensure_toy_assets(spec, log=log)
    return cached_build(f"toy-cross-{spec.key()}", pinned_build(build_cross_tokenizer_variant, spec, base, log=log))


def build_cross_tokenizer_variant(spec: ToySpec, base: Path, out: Path, log=info) -> dict:
    import torch

    use_build_threads()
    for item in ("student", "train.jsonl", "heldout.jsonl"):
        (shutil.copytree if (base / item).is_dir() else shutil.copyfile)(base / item, out / item)
    heldout = [json.loads(line) for line in (base / "heldout.jsonl").read_text().splitlines()]
    info = json.loads((base / "info.json").read_text())
    from transformers import AutoModelForCausalLM

    tok = build_pair_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(base / "teacher")
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    with torch.no_grad():  # a merged "dd" starts as the mean of the old rows (deterministic)
        for matrix in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            matrix[old:] = matrix[:old].mean(0)
    milestones = [("teacher", spec.teacher_target, spec.model.max_steps)]
    trained = train_toy_models(spec, tok, milestones, heldout, out, log=log, model=model)
    info.update(trained, teacher_tokenizer="the toy's characters plus doubled digits merged")
    (out / "info.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    return info


# -- chat format shared by the toys that speak it ----------------------------------------------------
END_OF_TURN = "<|end|>"
# Role markers and an end-of-turn token, as instruction models' templates have them.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" + END_OF_TURN + "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
