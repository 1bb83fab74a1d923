"""Process-wide caches are keyed by everything that defines what they hold: a parent run's folder by
this run's storage options too, a W&B run by the run's config and W&B settings too; and the seeding rule
lives in the foundation, where rollout and eval read it."""

import sys
import types
from dataclasses import replace
from types import SimpleNamespace

from gndpo.pipeline.observe import metrics
from gndpo.pipeline.settings.schema import Config
from gndpo.storage.products import FileRecord
from gndpo.storage.runfs import RunFS


def test_a_parent_run_is_opened_with_each_runs_own_storage_options(tmp_path):
    parent = str(tmp_path / "parent")
    (tmp_path / "parent").mkdir()
    record = FileRecord("rounds/r0000/rollout/data/u0/a001/part-00000.parquet", 0, "", run=parent)
    a = RunFS(str(tmp_path / "a"), {"auto_mkdir": True})
    b = RunFS(str(tmp_path / "b"), {"auto_mkdir": False})
    held_a, held_b = a.holding(record), b.holding(record)
    assert held_a.url == held_b.url == parent
    assert held_a is not held_b and held_a.fs is not held_b.fs
    assert held_a.storage_options == {"auto_mkdir": True} and held_b.storage_options == {"auto_mkdir": False}
    assert held_a.fs.auto_mkdir is True and held_b.fs.auto_mkdir is False
    assert a.holding(record) is held_a  # opened once per run
    assert a.holding(FileRecord("x", 0, "")) is a and a.holding(FileRecord("x", 0, "", run=a.url)) is a


def test_each_run_and_config_logs_to_its_own_wandb_run(tmp_path, monkeypatch):
    inits = []

    class FakeRun:
        def __init__(self, **kw):
            self.kw, self.rows = kw, []
            inits.append(self)

        def define_metric(self, *a, **k):
            pass

        def log(self, row):
            self.rows.append(row)

        def finish(self):
            pass

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: FakeRun(**kw)
    fake.Settings = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(metrics, "_WANDB", {})
    url = str(tmp_path / "run")
    first = Config()
    second = replace(first, train=replace(first.train, lr=first.train.lr * 2))  # the same folder, another config
    row = {"round": 0, "stage": "score", "tokens": 3}
    for cfg in (first, first, second):
        metrics.log_wandb(SimpleNamespace(cfg=cfg, fs=SimpleNamespace(url=url)), row, str(tmp_path / "logs"))
    assert len(inits) == 2 and inits[0].kw["id"] != inits[1].kw["id"]
    assert [len(r.rows) for r in inits] == [2, 1]
    # wandb's default would hand back the first run to the second init
    assert all(r.kw["reinit"] == "create_new" for r in inits)
    offline = replace(first, logging=replace(first.logging, wandb_mode="offline"))
    metrics.log_wandb(SimpleNamespace(cfg=offline, fs=SimpleNamespace(url=url)), row, str(tmp_path / "logs"))
    assert len(inits) == 3 and inits[2].kw["mode"] == "offline"


def test_rollout_and_eval_seed_with_the_foundations_rule():
    from gndpo.pipeline.run.seeds import derived_seed
    from gndpo.stages import rollout
    from gndpo.stages.text import heldout_eval

    assert rollout.derived_seed is heldout_eval.derived_seed is derived_seed
    assert derived_seed(0, 1, "p", 2) == derived_seed("0", "1", "p", "2") != derived_seed(0, 1, "p", 3)
    assert 0 <= derived_seed("eval", "p", 0) < 2**32
