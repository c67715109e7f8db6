"""cloudckpt's side of the OLMo-core tests, run on spawned ranks (module-level, importable)."""

from __future__ import annotations

from cloudckpt import Checkpointer

from .olmo_tool import _diff, _zeros_like, load_reference


def load_and_compare(rank: int, world_size: int, step: str, ref_path: str, work: str) -> list[str]:
    """Load ``step`` on this rank into zeros shaped like OLMo-core's own unsharded read
    (``olmo_tool.py truth``) and return where it differs, train state of this rank included."""
    ref = load_reference(ref_path)
    target = {"model": _zeros_like(ref["model"]), "optim": _zeros_like(ref["optim"])}
    with Checkpointer(work_dir=work) as ck:
        ts = ck.load(step, target)
    return (_diff(target["model"], ref["model"], "model") + _diff(target["optim"], ref["optim"], "optim")
            + _diff(ts, ref["train"][rank], f"train[{rank}]"))
