"""Metrics as JSON lines (``output_dir/metrics.jsonl``): an ``accelerate`` tracker beside its TensorBoard one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from accelerate.tracking import GeneralTracker


class JSONLTracker(GeneralTracker):
    """One ``{"step": ..., **values}`` line per ``accelerator.log`` call (main process only).

    When a run resumes from step ``s``, lines after ``s`` (written by the interrupted run after its last
    checkpoint) are dropped first, so the file reads as one uninterrupted run.
    """

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, output_dir: str | os.PathLike, resume_step: Optional[int] = None,
                 final_step: Optional[int] = None):
        super().__init__()
        self.path, self.resume_step, self.final_step = Path(output_dir) / "metrics.jsonl", resume_step, final_step

    @property
    def tracker(self) -> Path:
        return self.path

    def start(self) -> None:
        kept = []
        if self.resume_step is not None and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    # a run resumed at its last step measures the final validation again: one row of it
                    final = row.get("step") == self.resume_step == self.final_step and "val_loss" in row
                    if row.get("step", 0) <= self.resume_step and not final:
                        kept.append(line + "\n")
                except ValueError:  # a line cut short by the kill
                    pass
        self.path.write_text("".join(kept), encoding="utf-8")

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")

