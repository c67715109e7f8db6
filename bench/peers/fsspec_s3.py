"""DCP's fsspec storage layer with s3fs as a benchmark peer:
``torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter`` / ``FsspecReader``
on ``s3://`` (s3fs, aiobotocore), thread_count=2 like cloudckpt's default.

s3fs is given the bench's endpoint and credentials explicitly (from the standard
AWS env variables the bench sets), path-style addressing.
"""

from __future__ import annotations

import os


def _opts() -> dict:
    return {
        "endpoint_url": os.environ["AWS_ENDPOINT_URL"],
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"region_name": os.environ.get("AWS_REGION", "us-east-1")},
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }


def save(url, sd, ctx):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    writer = FsspecWriter(f"{url}/model_and_optim", thread_count=2, sync_files=False, overwrite=True, **_opts())
    dcp.save(sd, storage_writer=writer)
    return {}


def load(url, sd, ctx):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    dcp.load(sd, storage_reader=FsspecReader(f"{url}/model_and_optim", **_opts()))
    return {}
