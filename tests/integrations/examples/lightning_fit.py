"""Lightning with checkpoints and logs in a bucket: fit, then restart with
``ckpt_path="last"``, which resumes from the newest committed checkpoint in the bucket.

    python lightning_fit.py s3://my-bucket/run-1          # or gs://…, or a local folder
    python lightning_fit.py s3://my-bucket/run-2 --async  # uploads in the background

The test suite runs it against SeaweedFS (S3) and fake-gcs-server (GCS).
"""

import sys

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from cloudckpt.integrations.lightning import AsyncCloudCheckpointIO, AsyncFinalizerCallback, CloudCheckpointIO


class TinyModel(LightningModule):
    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()  # the CSVLogger writes them to {root}/lightning_logs/version_N/hparams.yaml
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def fit(root: str, max_steps: int, *, ckpt_path: str | None = None, async_save: bool = False, callbacks=()) -> Trainer:
    if async_save:
        # save_checkpoint returns after a copy to host memory; the callback commits
        # finished uploads at batch ends and waits for all of them at train end
        plugin, extra = AsyncCloudCheckpointIO(), [AsyncFinalizerCallback()]
    else:
        plugin, extra = CloudCheckpointIO(), []
    trainer = Trainer(
        default_root_dir=root,  # the default CSVLogger writes to {root}/lightning_logs/version_N/
        max_steps=max_steps,
        log_every_n_steps=2,
        plugins=[plugin],
        # each checkpoint is a committed folder {root}/checkpoints/epoch=…-step=….ckpt/
        callbacks=[ModelCheckpoint(dirpath=f"{root}/checkpoints", every_n_train_steps=4, save_top_k=-1),
                   *extra, *callbacks],
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModel(), ckpt_path=ckpt_path)
    return trainer


if __name__ == "__main__":
    root, async_save = sys.argv[1], "--async" in sys.argv
    fit(root, max_steps=8, async_save=async_save)  # commits step 4 and step 8
    # a restart: "last" is the newest committed checkpoint folder under the ModelCheckpoint's
    # dirpath (highest step, then newest commit); last_checkpoint(f"{root}/checkpoints") names it too
    trainer = fit(root, max_steps=12, ckpt_path="last", async_save=async_save)  # resumes at step 8
    print(f"resumed from {trainer.ckpt_path}, now at global_step {trainer.global_step}")
