"""Hugging Face Trainer with checkpoints in a bucket. Run it, kill it, run the same
command again: it resumes from the newest committed step (weights, AdamW state, LR
scheduler, RNG, global step) and finishes as an uninterrupted run would. (Rerunning a
job that already finished resumes at max_steps, trains one more step and commits it, as
transformers does with local checkpoints.)

    python examples/hf_trainer.py s3://my-bucket/hf-run-1      # or gs://…, or a local folder
    cloudckpt list s3://my-bucket/hf-run-1

The model is a tiny GPT-2 built from a config and the data are random token ids, so it
needs no download. The test suite runs this file against SeaweedFS and fake-gcs-server,
kills it with SIGKILL after a committed save, and checks the resumed run.
"""

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from cloudckpt.integrations.hf import CloudCheckpointCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16, vocab: int = 64):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(save_folder: str, *, max_steps: int = 8, output_dir: str | None = None, callbacks=()):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(prefix="hf-trainer-"),  # the Trainer's own local checkpoints
        max_steps=max_steps,
        save_steps=2,             # every save is also committed to save_folder by the callback
        save_total_limit=1,       # keep one local copy: the bucket has the others
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    cloud = CloudCheckpointCallback(save_folder, max_checkpoints=3)  # options of CheckpointConfig
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[cloud, *callbacks])
    return trainer, cloud


def main(save_folder: str, max_steps: int = 8, callbacks=()) -> Trainer:
    trainer, cloud = make_trainer(save_folder, max_steps=max_steps, callbacks=callbacks)
    # None when save_folder has no committed step yet; else a local checkpoint-N folder,
    # and the callback restores the optimizer and scheduler when training begins
    trainer.train(resume_from_checkpoint=cloud.prepare_resume())
    cloud.close()
    return trainer


if __name__ == "__main__":
    t = main(sys.argv[1], max_steps=int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    print(f"global_step {t.state.global_step}")
