"""How tests/data/run-6262a7f.tar.xz was made: a run folder written by gndpo at 6262a7f (the code before
typed stage products), round 0 whole and round 1's rollout and score, on the suite's tiny toy. Run with
that revision's code (not this checkout's), e.g.::

    git worktree add /tmp/old 6262a7f && mkdir /tmp/oldpkg && ln -s /tmp/old /tmp/oldpkg/gndpo
    cd /tmp/oldgen && GNDPO_CACHE=/tmp/oldcache PYTHONPATH=/tmp/oldpkg python make_run_6262a7f.py /tmp/oldgen/run
    rm -r run/logs && tar -cJf run-6262a7f.tar.xz run

tests/test_old_run.py finishes its round with this checkout's code.
"""

import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from gndpo.apps.demos.arithmetic import ModelSpec, ToySpec, ensure_toy_assets
from gndpo.cli.app import app, register


def ok(*args) -> None:
    """A gndpo command, in this process, that must succeed."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output


def main() -> None:
    register()
    out = Path(sys.argv[1])
    model = ModelSpec(layers=1, hidden=64, heads=2, max_steps=20, lr=3e-3, batch=32)
    assets = ensure_toy_assets(ToySpec(digits=2, n_train_prompts=96, n_heldout=24, model=model, student_max_steps=5), log=lambda *_: None)
    cfg = {"student": str(assets / "student"), "teacher": str(assets / "teacher"),
           "data": {"train": str(assets / "train.jsonl"), "heldout": str(assets / "heldout.jsonl")},
           "rollout": {"prompts_per_round": 16, "n": 2, "prompts_per_unit": 8, "max_tokens": 5},
           "score": {"rows_per_chunk": 8}, "train": {"lr": 1e-3, "optimizer_steps": 2, "micro_batch_size": 8},
           "engine": {"max_model_len": 32, "in_process": True}}
    (out.parent / "config.yaml").write_text(yaml.safe_dump(cfg))
    ok("init", out, "--config", out.parent / "config.yaml")
    for stage in ("rollout", "score", "normalize", "train"):
        ok(stage, out, "--round", 0)
    for stage in ("rollout", "score"):
        ok(stage, out, "--round", 1)
    print(assets)

if __name__ == "__main__":  # the toy build spawns a process, which imports this module again
    main()
