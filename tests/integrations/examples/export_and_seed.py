"""End of training: export the model weights (bf16 safetensors, streamed one tensor
at a time); then start a new run from that checkpoint as a seed (model only).

    python export_and_seed.py s3://my-bucket/run-1   # or gs://…, or a local folder
"""

import sys

import torch

from cloudckpt import AppState, Checkpointer
from cloudckpt.ops.export import export_weights


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def main(folder: str) -> dict:
    model = make_model()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optim.step()
    with Checkpointer(save_overwrite=True) as ckpt:
        ckpt.save(f"{folder}/step100", AppState(model, optim), {"step": 100})

        # Model weights only, cast to bfloat16, as one safetensors file next to the run.
        info = export_weights(f"{folder}/step100", f"{folder}/export/model.safetensors", dtype="bfloat16",
                              overwrite=True)
        print(f"exported {info['tensors']} tensors ({info['bytes']} bytes) to {info['dest']}")

        # A fresh run seeded from step100: load the model only, keep the fresh optimizer,
        # start at step 0 (no train state). exclude_from_loading=["optim"] would load
        # everything but the optimizer and still return the train state.
        seeded = make_model()
        seeded_optim = torch.optim.AdamW(seeded.parameters())
        assert ckpt.load(f"{folder}/step100", AppState(seeded, seeded_optim), model_only=True) is None
        assert not seeded_optim.state, "the fresh optimizer is kept"
    assert all(torch.equal(a, b) for a, b in zip(seeded.parameters(), model.parameters(), strict=True))
    return info


if __name__ == "__main__":
    main(sys.argv[1])
