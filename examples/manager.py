"""The trainer-facing manager: resume, periodic saves, retention.

    python examples/manager.py examples/manager_config.yaml [save_folder override]
"""

import sys

import torch

from cloudckpt import CheckpointConfig

overrides = {"save_folder": sys.argv[2]} if len(sys.argv) > 2 else {}
config = CheckpointConfig.from_yaml(sys.argv[1], section="checkpoint").replace(**overrides)

model = torch.nn.Linear(8, 4)
optim = torch.optim.AdamW(model.parameters())
state = {"model": model.state_dict(), "optim": optim.state_dict()}

manager = config.build()
train_state = manager.resume(state)  # newest committed step, or None on a fresh run
start = train_state["step"] + 1 if train_state else 1
if train_state:
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])

for step in range(start, start + 250):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    manager.maybe_save(step, state, {"step": step})  # applies the intervals; async if configured

manager.close()  # waits for in-flight saves and background pruning
print("resumed from", manager.resumed_step, "last saved", manager.last_saved_step)
