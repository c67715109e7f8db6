"""Quickstart: save, find and load a checkpoint. Works the same for a local
folder, s3:// and gs:// (the tests run it against all three).

    python examples/quickstart.py /tmp/ckpt/run-1
    python examples/quickstart.py s3://my-bucket/run-1
    python examples/quickstart.py gs://my-bucket/run-1
"""

import sys

import torch

from cloudckpt import Checkpointer

save_folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp/cloudckpt-quickstart/run-1"

model = torch.nn.Linear(8, 4)
optim = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 8)).sum().backward()
optim.step()

ckpt = Checkpointer(save_overwrite=True)
# A DCP state dict (tensors, DTensors, nested dicts) plus per-rank train state (plain data).
state = {"model": model.state_dict(), "optim": optim.state_dict()}
ckpt.save(f"{save_folder}/step100", state, {"step": 100, "epoch": 1})

latest = Checkpointer.latest_checkpoint(save_folder)  # only committed steps are found
print("latest:", latest)

restored = torch.nn.Linear(8, 4)
restored_optim = torch.optim.AdamW(restored.parameters())
state = {"model": restored.state_dict(), "optim": restored_optim.state_dict()}
train_state = ckpt.load(latest, state)  # loads in place, resharding if needed
restored.load_state_dict(state["model"])
restored_optim.load_state_dict(state["optim"])
assert torch.equal(restored.weight, model.weight)
print("train state:", train_state)
ckpt.close()
