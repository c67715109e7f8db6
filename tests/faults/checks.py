"""Deterministic states, and checks of what is on storage through the independent
oracle (oracle.py: the SDKs and raw JSON, no cloudckpt code)."""

from __future__ import annotations

import logging
import os

import google_crc32c
import torch

from cloudckpt.checkpoint import layout

from . import oracle

_ENV_KEYS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION",
             "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT", "AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE",
             "AWS_SHARED_CREDENTIALS_FILE")


def rank_env() -> dict:
    """The storage env of this (test) process, to hand to spawned ranks."""
    return {k: os.environ[k] for k in _ENV_KEYS if k in os.environ}


# ------------------------------------------------------------------ states
def step_state(step: int, rank: int, *, numel: int = 64 * 1024) -> dict:
    """Rank ``rank``'s state at ``step``: its own tensors (``w{rank}``, ``m{rank}``)
    and a replicated one (``shared``); every value is a function of (step, rank)."""
    g = torch.Generator().manual_seed(100_003 * step + rank)
    shared = torch.Generator().manual_seed(7 * step + 1)
    return {
        "model": {f"w{rank}": torch.randn(numel, generator=g), "shared": torch.randn(1024, generator=shared)},
        "optim": {f"m{rank}": torch.rand(numel // 2, generator=g)},
    }


def zero_state(world_size: int, *, numel: int = 64 * 1024, ranks=None) -> dict:
    ranks = range(world_size) if ranks is None else ranks
    return {
        "model": {**{f"w{r}": torch.zeros(numel) for r in ranks}, "shared": torch.zeros(1024)},
        "optim": {f"m{r}": torch.zeros(numel // 2) for r in ranks},
    }


def bitexact(sd: dict, step: int, world_size: int, *, numel: int = 64 * 1024, ranks=None) -> bool:
    ranks = range(world_size) if ranks is None else ranks
    for r in ranks:
        want = step_state(step, r, numel=numel)
        if not torch.equal(sd["model"][f"w{r}"], want["model"][f"w{r}"]):
            return False
        if not torch.equal(sd["optim"][f"m{r}"], want["optim"][f"m{r}"]):
            return False
        if not torch.equal(sd["model"]["shared"], want["model"]["shared"]):
            return False
    return True


# ------------------------------------------------------------------ oracle
def crc32c_hex(data: bytes) -> str:
    return google_crc32c.Checksum(data).hexdigest().decode()


def verify_step(dir: str) -> list[str]:
    """Problems of a committed step, judged by the independent oracle (oracle.py: the
    SDKs and raw JSON, no cloudckpt code): every manifest object exists with its size
    and CRC32C. ``[]`` means complete."""
    return oracle.verify_step(dir)


def library_verify(step: str) -> tuple[int, str]:
    """``cloudckpt verify STEP`` (the CLI, in process): exit code and output."""
    import contextlib
    import io

    from cloudckpt import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(["verify", step])
    return rc, out.getvalue()


def committed_steps(folder: str) -> list[int]:
    """Steps with a marker of ours, by the independent oracle (oracle.py)."""
    return oracle.committed_steps(folder)


def step_dir(folder: str, step: int) -> str:
    return layout.step_dir(folder, step)


def objects_under(prefix: str) -> list[str]:
    """Every object under the folder, listed by the independent oracle (oracle.py)."""
    return sorted(oracle.keys(prefix))


# ------------------------------------------------------------------ logs of a rank
class LogCapture(logging.Handler):
    """Every record a rank logs (INFO and up; cloudckpt from DEBUG), as text."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []
        root = logging.getLogger()
        root.addHandler(self)
        root.setLevel(logging.INFO)
        logging.getLogger("cloudckpt").setLevel(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - keep the raw parts of a malformed record
            self.lines.append(f"{record.msg} {record.args}")

    def text(self) -> str:
        return "\n".join(self.lines)
