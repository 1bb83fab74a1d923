"""Train's ranks on one node read a carried optimizer state (or an in-round checkpoint) from one
download: the node's first rank fetches and checks every file into the node's cache, the others wait
for it (8 ranks each fetched every partition: 8 downloads of the whole state), and the folder goes once
all have loaded. Two gloo ranks in two processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from gndpo.dist import Dist
from gndpo.pipeline.run.products import CarriedState
from gndpo.stages.training import checkpoint
from gndpo.storage.runfs import RunFS
from tests.conftest import free_ports


def rank_main(rank: int, url: str, state: CarriedState, out: str, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    download = checkpoint.download_state

    def counted(fs, state, folder):
        Path(out, f"download-by-rank-{rank}").touch()
        download(fs, state, folder)

    checkpoint.download_state = counted
    with checkpoint.node_state_folder(RunFS(url), state, Dist(rank=rank, world=2, local_rank=rank, launched=True)) as root:
        files = {p.name: p.read_bytes().decode() for p in (Path(root) / checkpoint.CHECKPOINT_TAG).iterdir()}
        Path(out, f"seen-by-rank-{rank}.json").write_text(json.dumps(files))
    dist.destroy_process_group()


def test_one_download_a_node_read_by_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("GNDPO_CACHE", str(tmp_path / "cache"))
    fs = RunFS(str(tmp_path / "run"))
    records = []
    for i in range(3):  # a state's files: the module states and each rank's optimizer partition
        data = f"partition {i}".encode()
        records.append(fs.write_new(f"state/part-{i}.pt", data).to_json())
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(rank_main, args=(fs.url, CarriedState(files=records, world=2), str(out), free_ports(1)[0]), nprocs=2)
    assert sorted(p.name for p in out.glob("download-by-rank-*")) == ["download-by-rank-0"]
    want = {f"part-{i}.pt": f"partition {i}" for i in range(3)}
    assert all(json.loads((out / f"seen-by-rank-{r}.json").read_text()) == want for r in (0, 1))
    assert not any((tmp_path / "cache" / "states").iterdir())  # removed once both had loaded
    assert os.environ["GNDPO_CACHE"] == str(tmp_path / "cache")
