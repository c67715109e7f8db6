"""Accelerate training loop with checkpoints in a bucket. Run it, kill it, run the same
command again: it resumes from the newest committed step (weights, AdamW state, LR
scheduler, RNG) and finishes as an uninterrupted run would.

    python examples/hf_accelerate.py s3://my-bucket/acc-run-1   # or gs://…, or a local folder

The model is a tiny Llama built from a config, trained on random token ids drawn from
torch's RNG (so the RNG must come back too). The test suite runs this file against
SeaweedFS and fake-gcs-server, kills it with SIGKILL after a committed save, and checks
the resumed run.
"""

import sys

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from cloudckpt.integrations.hf_accelerate import AcceleratorCheckpointer


def train(save_folder: str, max_steps: int = 8, *, after_save=None, after_resume=None):
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.1)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    ckpt = AcceleratorCheckpointer(accelerator, save_folder, model=model, optimizer=optimizer,
                                   scheduler=scheduler, save_interval=2, max_checkpoints=3)
    train_state = ckpt.load_state()  # None: nothing committed yet, start fresh
    start = train_state["step"] if train_state else 0
    if train_state and after_resume:
        after_resume(start, model, optimizer, scheduler)
    model.train()
    for step in range(start + 1, max_steps + 1):
        ids = torch.randint(0, 64, (4, 16))  # from the RNG that the checkpoint restores
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if ckpt.maybe_save_state(step, {"step": step}) and after_save:
            after_save(step, model, optimizer, scheduler)
    ckpt.close()
    return model, optimizer, scheduler


if __name__ == "__main__":
    train(sys.argv[1], max_steps=int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    print("done")
