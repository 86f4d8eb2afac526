"""The LightningModule and callback that tests/test_integration_lightning.py trains, and its worker.

Apart from the test file, so that collecting it does not import Lightning (4 s on a 2-core machine):
the tests that train import this module when they run.
"""

from __future__ import annotations

import lightning as L
import torch
from test_integration_lightning import optimizer_and_scheduler
from tiny_models import token_loss

from memfit.capture.tracker import MemoryTracker


class LitLM(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.logged: list[float] = []

    def training_step(self, batch, batch_idx):
        s, c = token_loss(self.model, batch)
        loss = s / c  # this micro-batch's token mean, as a Lightning user writes it
        self.log("train_loss", loss, on_step=True, prog_bar=True, batch_size=batch["idx"].shape[0])
        self.logged.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        opt, sched = optimizer_and_scheduler(self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Peak(L.Callback):
    """The live-tensor peak of the whole training run (forward, backward, optimizer step)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.tracker = MemoryTracker(device="cpu").track(pl_module, trainer.optimizers[0])
        self.tracker.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        self.tracker.__exit__(None, None, None)
