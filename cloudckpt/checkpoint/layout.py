"""Names on storage: the one module that spells a step's objects (compatible with
OLMo-core's layout)::

    {save_folder}/step{N}/
        train/rank{R}.pt          per-rank train state (torch.save of plain data)
        model_and_optim/          a standard DCP checkpoint: .metadata + __{R}_{K}.distcp
        index/header.json         the DCP index's header (rank 0; dcp/index)
        index/rank{R}.json        rank R's part of the DCP index
        manifest/rank{R}.json     rank R's manifest part (checkpoint/parts.py)
        .lock                     held while a save of this step runs (deleted after commit)
        .metadata.json            the commit marker, written LAST, by one rank, once
        .cloudckpt.json           our manifest beside another tool's marker (``cloudckpt adopt``)

Every name here is relative to the step folder. Import-light (the standard library
and ``cloudckpt.errors``): the marker's schema and the DCP index import it.
"""

from __future__ import annotations

import re

from ..errors import NotACheckpoint

MARKER = ".metadata.json"
LOCK = ".lock"
TRAIN_DIR = "train"
MODEL_DIR = "model_and_optim"
DCP_METADATA = f"{MODEL_DIR}/.metadata"  # DCP's own file name, fixed by torch.distributed.checkpoint
PARTS_DIR = "manifest"  # step{N}/manifest/rank{R}.json
INDEX_DIR = "index"  # step{N}/index/header.json, step{N}/index/rank{R}.json
INDEX_HEADER = f"{INDEX_DIR}/header.json"
REPLACE_DIR = ".replace"  # step{N}/.replace/{save id}/: a replaced step's objects (marker format 4)
ADOPTED_MANIFEST = ".cloudckpt.json"  # our manifest beside another tool's marker (``cloudckpt adopt``)
LATEST_POINTER = "latest"

# the one spelling of a step folder: ASCII digits, no leading zero (step0 is allowed), at
# most 19 digits (below 2**63). ``step04``, ``step٤`` or ``step4.bak`` are not steps: they
# are never counted, kept or deleted by retention (``list --all`` shows them as junk).
_STEP_RE = re.compile(r"step(0|[1-9][0-9]{0,18})")
# names that look like a step folder and are not one (shown as junk, never counted)
_STEPLIKE_RE = re.compile(r"step\D{0,3}\d", re.IGNORECASE)

# a rank (captured) and a file number in a name: ASCII digits, no leading zero, at most 9
_R = r"(0|[1-9][0-9]{0,8})"
_K = r"(?:0|[1-9][0-9]{0,8})"
_SHARD = re.compile(rf"__{_R}_{_K}\.distcp")  # DCP's shard file, under MODEL_DIR
_SHARD_FILE = re.compile(rf"{MODEL_DIR}/__{_R}_{_K}\.distcp")
_INDEX_PART = re.compile(rf"{INDEX_DIR}/rank{_R}\.json")
_RANK_RE = re.compile(rf"{TRAIN_DIR}/rank{_R}\.pt")


def train_state_name(rank: int) -> str:
    return f"{TRAIN_DIR}/rank{rank}.pt"


def rank_of_train_state(path: str) -> int | None:
    """``train/rank3.pt`` -> 3; anything else (``train/rank03.pt`` too) -> None."""
    m = _RANK_RE.fullmatch(path)
    return int(m.group(1)) if m else None


def part_name(rank: int) -> str:
    """The manifest part of rank ``rank``."""
    return f"{PARTS_DIR}/rank{int(rank)}.json"


def index_part_name(rank: int) -> str:
    """The DCP index part of rank ``rank``."""
    return f"{INDEX_DIR}/rank{int(rank)}.json"


def shard_writer(rel: str) -> int | None:
    """The rank that wrote the shard file ``rel``, relative to ``MODEL_DIR`` (DCP's
    ``__{rank}_{k}.distcp``), else None."""
    m = _SHARD.fullmatch(rel)
    return int(m.group(1)) if m else None


def owner_of(path: str) -> int | None:
    """The rank whose part lists ``path`` (its shard files ``model_and_optim/__{R}_{K}.distcp``,
    its train state ``train/rank{R}.pt`` and its DCP index part ``index/rank{R}.json``), or
    None for the step's own files (DCP's ``.metadata``, ``index/header.json``), listed in
    the marker itself."""
    m = _SHARD_FILE.fullmatch(path) or _INDEX_PART.fullmatch(path)
    return int(m.group(1)) if m is not None else rank_of_train_state(path)


def step_dir(folder: str, step: int) -> str:
    from ..storage import url as urls

    return urls.join(folder, f"step{int(step)}")


def step_of_name(name: str) -> int | None:
    """``step12`` -> 12; anything else -> None. Names must be exactly ``step{N}`` in its
    canonical spelling: ``step0``, ``step12``; not ``step012``, ``Step12``, ``step12/x``."""
    m = _STEP_RE.fullmatch(name[:-1] if name.endswith("/") else name)
    return int(m.group(1)) if m else None


def is_step_junk(name: str) -> bool:
    """True for a folder name that looks like a step and is not one (``step04``,
    ``STEP4``, ``step4.old``, ``step-4``, ``step 4``: "step", up to three other
    characters, a digit): listed as junk by ``cloudckpt list --all``, never a step."""
    name = name[:-1] if name.endswith("/") else name
    return step_of_name(name) is None and _STEPLIKE_RE.match(name) is not None


def parse_step_dir(dir: str) -> int:
    """The step number of a checkpoint folder. Raises NotACheckpoint if the last
    path component is not exactly ``step{N}``."""
    from ..storage import url as urls

    step = step_of_name(urls.basename(dir))
    if step is None:
        raise NotACheckpoint(
            f"{dir!r} is not a step folder: checkpoint folders are named step{{N}} inside the save folder, "
            "e.g. s3://bucket/run-7/step1000"
        )
    return step


def marker_url(dir: str) -> str:
    from ..storage import url as urls

    return urls.join(dir, MARKER)
