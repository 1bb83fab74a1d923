"""A toy build saves each checkpoint when its own measurement passes its target (train_supervised's
milestones): the tool-use toy's teacher is judged by its exact match, its student by how rarely it calls."""

import torch

from gndpo.apps.demos.arithmetic import ModelSpec, new_model, train_supervised

SPEC = ModelSpec(layers=1, hidden=32, heads=2, max_steps=100, lr=1e-3, batch=4)


def train_tiny(validate, milestones: list, on_milestone) -> int:
    """train_supervised on a 1-layer model and one fixed batch of random tokens."""
    ids = torch.randint(0, 8, (4, 6), generator=torch.Generator().manual_seed(0))
    return train_supervised(new_model(SPEC, vocab_size=8, context=8), SPEC, 0, lambda rng: (ids, torch.ones_like(ids)),
                            validate, milestones, on_milestone, log=lambda _: None)


def test_each_milestone_is_judged_by_its_own_measurement():
    asked: list[str] = []

    def validate(milestone: str) -> float:
        asked.append(milestone)
        # "teacher" passes at once; "student" measures something else, which passes at its third check
        return 1.0 if milestone == "teacher" or asked.count("student") >= 3 else 0.0

    saved = []
    steps = train_tiny(validate, [("teacher", 0.9, 100), ("student", 0.9, 100)], lambda *reached: saved.append(reached))
    # The student is not reached at step 10 by the teacher's 1.0: it is measured again, at the same step.
    assert saved == [("teacher", 10, 1.0), ("student", 30, 1.0)]
    assert asked == ["teacher", "student", "student", "student"] and steps == 30


def test_a_milestone_that_never_passes_is_reached_at_its_step_cap():
    saved = []
    train_tiny(lambda milestone: 0.0, [("teacher", 0.9, 20), ("student", 0.9, 50)], lambda *reached: saved.append(reached[:2]))
    assert saved == [("teacher", 20), ("student", 50)]
