"""The trainer-facing manager: resume, periodic saves, retention.

    python examples/manager.py examples/manager_config.yaml [save_folder override] [steps per run]
"""

import sys

import torch

from cloudckpt import AppState, CheckpointConfig

overrides = {"save_folder": sys.argv[2]} if len(sys.argv) > 2 else {}
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 250
config = CheckpointConfig.from_yaml(sys.argv[1], section="checkpoint").replace(**overrides)

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=1000)
state = AppState(model, optim, sched)  # built once; read at every save, restored in place by resume

manager = config.build()
train_state = manager.resume(state)  # newest committed step (model, AdamW moments, scheduler), or None
start = train_state["step"] + 1 if train_state else 1

for step in range(start, start + steps):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    sched.step()
    manager.maybe_save(step, state, {"step": step})  # applies the intervals; async if configured

manager.close()  # waits for in-flight saves and background pruning
print("resumed from", manager.resumed_step, "last saved", manager.last_saved_step, "lr", sched.get_last_lr()[0])
