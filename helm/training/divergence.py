"""Divergence that stays finite: a training loss that blows up without ever becoming NaN or inf.

The rule (recipe keys ``train.divergence_factor`` and ``train.divergence_patience``): a step is *blown up* when its
training loss is above both

* ``divergence_factor`` times the lowest running level seen so far (the running level is an exponential moving
  average of the step losses, weight ``1 / RUNNING_STEPS`` on the newest), and
* the loss of the first step of the run (an untrained model's loss: a model worse than that is not learning);

the run has diverged when ``divergence_patience`` consecutive steps are blown up. One spike is not divergence;
a loss that climbed back above the untrained model's, several times its best level, and stays there is. The
state lives on the device and is updated without a host read; ``train.py`` reads it where it synchronises anyway
(logging, checkpoints), and it is saved with the checkpoint so that a resumed run judges the same way.
"""

from __future__ import annotations

from typing import Optional

import torch

RUNNING_STEPS = 10


class DivergenceMonitor:
    """Device-side detector of a finite blow-up of the training loss (module docstring); ``factor=None`` disables
    it."""

    def __init__(self, factor: Optional[float], patience: int, device):
        self.factor, self.patience = factor, patience
        # first step's loss, running level, lowest running level, consecutive blown-up steps, step the streak began
        self.values = torch.tensor([float("nan"), float("nan"), float("inf"), 0.0, 0.0], dtype=torch.float32,
                                   device=device)
        self.diverged_at = torch.zeros((), dtype=torch.long, device=device)  # step the streak began, 0 = none

    def update(self, loss: torch.Tensor, step: int) -> None:
        """Account for the (finite or not: non-finite steps are the NaN check's) loss of ``step`` (1-based)."""
        if self.factor is None:
            return
        first, level, lowest, streak, began = self.values.unbind()
        loss = loss.detach().to(self.values)
        first = torch.where(first.isnan(), loss, first)
        level = torch.where(level.isnan(), loss, level + (loss - level) / RUNNING_STEPS)
        lowest = torch.minimum(lowest, level)
        blown = (loss > self.factor * lowest) & (loss > first) & loss.isfinite()
        began = torch.where(blown & (streak == 0), torch.full_like(began, step), began)
        streak = torch.where(blown, streak + 1, torch.zeros_like(streak))
        began = torch.where(blown, began, torch.zeros_like(began))
        self.values = torch.stack([first, level, lowest, streak, began])
        hit = (streak >= self.patience) & self.diverged_at.eq(0)
        self.diverged_at = torch.where(hit, began.long(), self.diverged_at)

    def report(self) -> Optional[str]:
        """None, or what diverged (reads the device: call it where the loop synchronises anyway)."""
        step = int(self.diverged_at)
        if not step:
            return None
        first, _, lowest, _, _ = self.values.tolist()
        return (f"from step {step} on the training loss stayed above {self.factor:g} x its lowest running level "
                f"({lowest:.4g}) and above the first step's loss ({first:.4g}) for {self.patience} steps "
                "(train.divergence_factor, train.divergence_patience)")

    def state_dict(self) -> dict:
        return {"values": self.values.tolist(), "diverged_at": int(self.diverged_at)}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state:  # checkpoints written before the monitor existed start it afresh
            self.values = torch.tensor(state["values"], dtype=torch.float32, device=self.values.device)
            self.diverged_at.fill_(state["diverged_at"])
