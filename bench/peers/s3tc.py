"""s3torchconnector (``s3torchconnector[dcp]``) as a benchmark peer: DCP with its
``S3StorageWriter`` / ``S3StorageReader`` (AWS CRT client via mountpoint-s3-client),
thread_count=2 like cloudckpt's default, path-style addressing
(``S3ClientConfig(force_path_style=True)``; SeaweedFS on 127.0.0.1 has no
virtual-host DNS). The endpoint is not passed: the client reads
``AWS_ENDPOINT_URL`` from the environment, as its docs say.
"""

from __future__ import annotations

import os


def _cfg():
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)


def _region() -> str:
    return os.environ.get("AWS_REGION", "us-east-1")


def save(url, sd, ctx):
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageWriter

    writer = S3StorageWriter(_region(), f"{url}/model_and_optim", s3client_config=_cfg(), thread_count=2)
    dcp.save(sd, storage_writer=writer)
    return {}


def load(url, sd, ctx):
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageReader

    dcp.load(sd, storage_reader=S3StorageReader(_region(), f"{url}/model_and_optim", s3client_config=_cfg()))
    return {}
