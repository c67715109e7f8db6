"""Exact resume (Megatron-style train state): capture and restore, per rank, the RNG
states of Python ``random``, NumPy, torch CPU (and CUDA when present) and the state of
stateful data loaders (torchdata's ``StatefulDataLoader`` or anything with
``state_dict``/``load_state_dict``), as plain data that ``torch.load(weights_only=True)``
accepts. The manager stores them under one key of the per-rank train state. A
``StatefulDataLoader`` with workers also carries each worker's RNG states inside its
own state (``WORKER_KEY``, put there by ``checkpoint/loaders.py``): they are checked
here like the rank's own before the loader gets them.

That state comes back from a checkpoint anyone with write access may have crafted:
``restore`` checks every value's type and shape before it restores anything (a
Python RNG state is a version, 625 words and a gauss; torch's a CPU byte tensor of
torch's own length; NumPy's MT19937 keys 624 words), and a value of the wrong type
is a CorruptCheckpoint naming the step, never an AttributeError from deep inside
``random`` or torch."""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from .errors import CorruptCheckpoint

log = logging.getLogger(__name__)


def capture_rng_state(*, cuda: bool = True) -> dict[str, Any]:
    """This process's Python, torch CPU, NumPy (when installed) and, with ``cuda`` and
    CUDA present, CUDA RNG states. Loader workers pass ``cuda=False``: a forked worker
    must not initialize CUDA."""
    state: dict[str, Any] = {"python": _py_to_plain(random.getstate()), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    except ImportError:
        pass  # NumPy is optional: nothing to capture
    if cuda and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], *, where: str = "the checkpoint") -> list[str]:
    """Restore what the state holds; returns the names restored. Raises
    CorruptCheckpoint (naming ``where``) when a value is not what ``capture_rng_state``
    writes; then nothing was restored."""
    _check_rng(state, where)
    try:
        return _restore_rng(state)
    except (TypeError, ValueError, RuntimeError, IndexError, KeyError, AttributeError, OverflowError) as e:
        raise _bad(where, f"the RNG state does not restore ({type(e).__name__}: {str(e)[:200]})") from None


def _restore_rng(state: dict[str, Any]) -> list[str]:
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
WORKER_KEY = "cloudckpt_worker_rng"  # a loader worker's RNG states, in its dataset state


def capture(loaders: dict[str, Any]) -> dict[str, Any]:
    """Everything exact resume needs from this rank."""
    return {"rng": capture_rng_state(), "loaders": {name: dl.state_dict() for name, dl in loaders.items()}}


def restore(state: dict[str, Any], loaders: dict[str, Any], *, same_world_size: bool,
            where: str = "the checkpoint") -> tuple[list[str], list[str]]:
    """Restore RNG and loader states; returns (restored, not_restored) names. With a
    changed world size the per-rank states of this rank do not exist: nothing is
    restored and the caller says so. Raises CorruptCheckpoint naming ``where`` (the
    step) when the state is not what ``capture`` writes (checked before anything is
    restored), or when a loader refuses its state with a TypeError, ValueError,
    KeyError, IndexError or AttributeError."""
    names = ["rng"] + [f"loader:{n}" for n in loaders]
    if not same_world_size:
        return [], names
    if type(state) is not dict:
        raise _bad(where, f"it is a {type(state).__name__}, not a dict")
    saved = state.get("loaders", {})
    if type(saved) is not dict:
        raise _bad(where, f"its loaders are a {type(saved).__name__}, not a dict")
    for name in loaders:
        for rng in _worker_rngs(saved.get(name)):
            _check_rng(rng, where)
    done = [f"rng:{n}" for n in restore_rng_state(state.get("rng", {}), where=where)]
    missing = []
    for name, dl in loaders.items():
        if name in saved:
            try:
                dl.load_state_dict(saved[name])
            except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
                raise _bad(where, f"data loader {name!r} refused its saved state ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from e
            done.append(f"loader:{name}")
        else:
            missing.append(f"loader:{name}")
    return done, missing


def _worker_rngs(loader_state: Any) -> list[Any]:
    """The worker RNG states in a ``StatefulDataLoader`` state (``_snapshot`` ->
    ``_worker_snapshots`` -> ``worker_N`` -> ``dataset_state`` -> ``WORKER_KEY``)."""
    snapshot = loader_state.get("_snapshot") if type(loader_state) is dict else None
    workers = snapshot.get("_worker_snapshots") if type(snapshot) is dict else None
    if type(workers) is not dict:
        return []
    found = []
    for worker in workers.values():
        ds = worker.get("dataset_state") if type(worker) is dict else None
        if type(ds) is dict and WORKER_KEY in ds:
            found.append(ds[WORKER_KEY])
    return found


_PY_WORDS = 625  # random.getstate()'s internal state: 624 words and the position


def _bad(where: str, what: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{where}: the exact-resume state ({KEY}) is not what cloudckpt saves: {what}; "
                             "resume from another step, or set exact_resume=False to skip it")


def _is_cpu_tensor(t: Any, dtype: torch.dtype, numel: int | None = None) -> bool:
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu" and t.dtype == dtype
            and t.dim() == 1 and (numel is None or t.numel() == numel))


def _check_rng(rng: Any, where: str) -> None:
    """What ``capture_rng_state`` writes, checked by type and shape (nothing restored yet)."""
    if type(rng) is not dict:
        raise _bad(where, f"the RNG state is a {type(rng).__name__}, not a dict")
    if "python" in rng:
        p = rng["python"]
        ok = type(p) in (list, tuple) and len(p) == 3 and type(p[0]) is int and type(p[1]) in (list, tuple) \
            and len(p[1]) == _PY_WORDS and all(type(w) is int and 0 <= w < 1 << 32 for w in p[1]) \
            and (p[2] is None or type(p[2]) is float)
        if not ok:
            raise _bad(where, "the Python RNG state is not [version, 625 words, gauss]")
    if "torch" in rng and not _is_cpu_tensor(rng["torch"], torch.uint8, torch.get_rng_state().numel()):
        raise _bad(where, "the torch RNG state is not a CPU byte tensor of torch's RNG state length")
    if "numpy" in rng:
        n = rng["numpy"]
        ok = type(n) is dict and n.get("kind") == "MT19937" and _is_cpu_tensor(n.get("keys"), torch.int64, 624) \
            and type(n.get("pos")) is int and 0 <= n["pos"] <= 624 and n.get("has_gauss") in (0, 1) \
            and type(n.get("has_gauss")) is int and type(n.get("gauss")) is float
        if not ok:
            raise _bad(where, "the NumPy RNG state is not MT19937 with 624 keys, a position and a gauss")
    if "cuda" in rng:
        c = rng["cuda"]
        if type(c) not in (list, tuple) or len(c) > 1024 or not all(_is_cpu_tensor(t, torch.uint8) for t in c):
            raise _bad(where, "the CUDA RNG states are not a list of CPU byte tensors")
