"""The run's wandb run: one per run directory, continued by every resume of that run."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from megatron_quads.atomic_io import write_text_atomic
from megatron_quads.controller.config import RunConfig

RUN_ID_NAME = "wandb_run_id"
"""The file in the run directory that holds the wandb run id its resumes continue."""


def wandb_run_id(run_dir: Path, resumed: bool) -> str:
    """The wandb run id of this start: a resume continues the id the run directory holds; a fresh run
    (or a resume of a run that recorded none) gets a new one, recorded there."""
    path = run_dir / RUN_ID_NAME
    if resumed and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    write_text_atomic(path, run_id + "\n")
    return run_id


def start_wandb(cfg: RunConfig, resumed: bool) -> Any:
    """A wandb run for ``cfg`` in ``logging.wandb``'s mode, writing under the run directory; a resume
    continues the run's wandb run (``resume="allow"`` with the recorded id; offline, ``wandb sync`` of
    its directories appends them to one run)."""
    import wandb

    run_dir = Path(cfg.run_dir)
    return wandb.init(
        project=cfg.logging.project, mode=cfg.logging.wandb, dir=str(run_dir), config=cfg.model_dump(mode="json"),
        name=run_dir.name, id=wandb_run_id(run_dir, resumed), resume="allow", reinit="finish_previous",
    )
