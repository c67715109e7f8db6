"""Quickstart: save, find and load a checkpoint, and check that the resume restored
everything. Works the same for a local folder, s3:// and gs:// (the tests run it
against all three).

    python examples/quickstart.py /tmp/ckpt/run-1
    python examples/quickstart.py s3://my-bucket/run-1
    python examples/quickstart.py gs://my-bucket/run-1
"""

import sys

import torch

from cloudckpt import AppState, Checkpointer

save_folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp/cloudckpt-quickstart/run-1"


def build():
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=10, gamma=0.5)
    return model, optim, sched


torch.manual_seed(0)
model, optim, sched = build()
for _ in range(3):  # a few steps, so that AdamW has moments and the scheduler has moved
    model(torch.randn(2, 8)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()
    sched.step()

ckpt = Checkpointer(save_overwrite=True)
# AppState: model, optimizer and scheduler as one DCP state; build it once, pass it to
# every save and load. The train state (plain data, per rank) goes beside it.
state = AppState(model, optim, sched)
ckpt.save(f"{save_folder}/step100", state, {"step": 100, "epoch": 1})

latest = Checkpointer.latest_checkpoint(save_folder)  # only committed steps are found
print("latest:", latest)

# A new process would build fresh objects; AppState creates the optimizer's state
# before loading, so the moments are restored, not dropped.
model2, optim2, sched2 = build()
train_state = ckpt.load(latest, AppState(model2, optim2, sched2))  # in place, resharding if needed
assert torch.equal(model2.weight, model.weight)
for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(optim2.state[p2][k], optim.state[p][k]), k
assert sched2.state_dict() == sched.state_dict() and optim2.param_groups[0]["lr"] == optim.param_groups[0]["lr"]
print("restored: weights, AdamW moments and step, LR scheduler")
print("train state:", train_state)
ckpt.close()
