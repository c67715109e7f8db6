"""Stock DCP ``FileSystemWriter`` to a local folder: writes the bytes that the s5cmd
rows then upload (the same model + Adam state, the same DCP file format)."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp


def save(url, sd, ctx):
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(url, thread_count=2, sync_files=False))
    return {}


def load(url, sd, ctx):
    dcp.load(sd, storage_reader=dcp.FileSystemReader(url))
    return {}
