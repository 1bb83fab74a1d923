"""`gndpo export`: a trained policy out of a run, as a folder that needs neither gndpo nor the run.

A run keeps each round's student where train committed it (``rounds/r<k>/train/data/update/a<n>/model``)
and vouches for every file with its commit record. ``export_policy`` copies one policy's files from
there (the newest by default) to a folder of the user's, checking each file's sha256 against the record
first: the student's Hugging Face folder (weights, config, tokenizer, chat template; for a ``model.lora``
student the merged weights), or with ``adapters`` the PEFT adapters alone, which
``PeftModel.from_pretrained(initial_student, folder)`` reads. gndpo's own files (the engine probe) stay
in the run.
"""

from __future__ import annotations

from gndpo.errors import GndpoError
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.lora import ADAPTER_DIR
from gndpo.stages.models.probe import PROBE_FILE
from gndpo.storage.runfs import export_files


def export_policy(run_url: str, out: str, version: int | None = None, adapters: bool = False) -> dict:
    """Copy policy ``version`` of the run at ``run_url`` (0 is the initial student, k the student after k
    trained rounds; default the newest) into the new folder ``out``; returns what was written
    (``version``, ``files``, ``bytes``). One-line errors for a policy that does not exist yet, for the
    initial student (the run holds no copy of it), and for ``adapters`` where the student has none."""
    run = open_run(run_url)
    policy = run.committed_policy(version)
    adapter_dir = f"{policy.model_dir}/{ADAPTER_DIR}"
    if adapters:
        files = [f for f in policy.files if f.under(adapter_dir)]
        if not files:
            raise GndpoError(f"policy v{policy.version} of {run_url} has no adapters (model.lora was off); export it without --adapters")
        prefix = adapter_dir
    else:
        probe = f"{policy.model_dir}/{PROBE_FILE}"
        files = [f for f in policy.files if not f.under(adapter_dir) and f.path != probe]
        prefix = policy.model_dir
    # The run's storage options (an S3 endpoint, credentials) serve an OUT on the same kind of storage.
    same_kind = out.partition("://")[0] == run_url.partition("://")[0] and "://" in out
    written = export_files(policy.records.run, files, prefix, out, run.fs.storage_options if same_kind else None)
    return {"version": policy.version, "files": len(written), "bytes": sum(f.bytes for f in written)}
