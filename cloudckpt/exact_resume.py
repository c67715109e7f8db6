"""Exact resume (Megatron-style train state): capture and restore, per rank, the RNG
states of Python ``random``, NumPy, torch CPU (and CUDA when present) and the state of
stateful data loaders (torchdata's ``StatefulDataLoader`` or anything with
``state_dict``/``load_state_dict``), as plain data that ``torch.load(weights_only=True)``
accepts. The manager stores them under one key of the per-rank train state."""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

log = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": _py_to_plain(random.getstate()), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    except ImportError:
        pass  # NumPy is optional: nothing to capture
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> list[str]:
    """Restore what the state holds; returns the names restored."""
    done = []
    if "python" in state:
        random.setstate(_plain_to_py(state["python"]))
        done.append("python")
    if "torch" in state:
        torch.set_rng_state(state["torch"])
        done.append("torch")
    if "numpy" in state:
        try:
            import numpy as np

            n = state["numpy"]
            np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))
            done.append("numpy")
        except ImportError:
            log.warning("the checkpoint has a NumPy RNG state but NumPy is not installed: not restored")
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
            done.append("cuda")
        else:
            log.warning("CUDA device count changed: CUDA RNG states not restored")
    return done


def _py_to_plain(s):
    version, internal, gauss = s
    return [version, list(internal), gauss]


def _plain_to_py(s):
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


KEY = "cloudckpt_resume"


def capture(loaders: dict[str, Any]) -> dict[str, Any]:
    """Everything exact resume needs from this rank."""
    return {"rng": capture_rng_state(), "loaders": {name: dl.state_dict() for name, dl in loaders.items()}}


def restore(state: dict[str, Any], loaders: dict[str, Any], *, same_world_size: bool) -> tuple[list[str], list[str]]:
    """Restore RNG and loader states; returns (restored, not_restored) names. With a
    changed world size the per-rank states of this rank do not exist: nothing is
    restored and the caller says so."""
    names = ["rng"] + [f"loader:{n}" for n in loaders]
    if not same_world_size:
        return [], names
    done = [f"rng:{n}" for n in restore_rng_state(state.get("rng", {}))]
    missing = []
    for name, dl in loaders.items():
        if name in state.get("loaders", {}):
            dl.load_state_dict(state["loaders"][name])
            done.append(f"loader:{name}")
        else:
            missing.append(f"loader:{name}")
    return done, missing
