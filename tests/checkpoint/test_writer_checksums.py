"""The DCP writer checksums files while writing them, and shard files are uploaded
by name, so a save reads nothing back and S3 uploads hold no parts in memory."""

from __future__ import annotations

import os

import pytest
import torch
from memprobe import PeakRss

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls
from cloudckpt.transfer import TransferEngine, crc32c_bytes, crc32c_file


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(64, 64, generator=g)
    return {
        "model": {
            "w": torch.randn(300, 7, generator=g),
            "view": big[::2, 1:],  # non-contiguous: DCP clones it before writing
            "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
            "ints": torch.arange(1000, dtype=torch.int64),
            "empty": torch.empty(0),
        },
        "extra": {"name": "run-7", "lrs": [0.1, 0.01]},  # non-tensor values: DCP BYTE_IO items
        "step": 12,
    }


def test_every_crc_in_the_marker_comes_from_the_writer_and_matches_the_bytes(tmp_path):
    root = str(tmp_path / "ckpt")
    step = urls.join(root, "step1")
    # the item CRCs come from the DCP writer's own manifest (UploadingWriter.manifest()): the
    # checkpointer has no way left to read a file back for them
    with Checkpointer(work_dir=str(tmp_path / "w"), distributed=False) as ck:
        saved = ck.save(step, _state(), {"k": 1})
    marker = discovery.read_marker(step)  # every object, the manifest part read and checked
    store = open_store(root)
    chunks_seen = 0
    for o in marker.objects:
        data = store.get_bytes(urls.join(step, o.path))
        assert len(data) == o.size and crc32c_bytes(data) == o.crc32c, o.path
        for off, n, crc in o.chunks:
            assert crc32c_bytes(data[off:off + n]) == crc, (o.path, off, n)
            chunks_seen += 1
    assert chunks_seen >= 7  # every tensor and non-tensor item has its own CRC
    assert saved.save_id == marker.save_id

    # and the checkpoint loads bit-exactly with those CRCs verified
    target = _state()
    for t in target["model"].values():
        t.zero_() if t.numel() else None
    target["extra"] = {"name": "", "lrs": []}
    with Checkpointer(work_dir=str(tmp_path / "w"), distributed=False) as ck:
        ck.load(step, target)
    for k, v in _state()["model"].items():
        assert torch.equal(target["model"][k], v), k
    assert target["extra"] == {"name": "run-7", "lrs": [0.1, 0.01]}


@pytest.mark.slow  # a 256 MiB shard and an 80 MiB warm-up upload
def test_s3_upload_by_name_holds_no_parts_in_memory(s3_bucket, tmp_path, shard_file):
    """s3transfer reads a file object's parts into memory (16 MiB each, up to
    ``max_in_memory_upload_chunks``); by file name it reads each part as it sends it."""
    path, size, crc = shard_file
    url = s3_bucket + "/big/shard.distcp"
    with TransferEngine() as eng:
        warm = tmp_path / "warm"
        warm.write_bytes(os.urandom(80 << 20))  # a multipart upload: client, pools and threads exist
        eng.submit_upload(str(warm), s3_bucket + "/warm", crc32c=crc32c_file(warm)).result()
        with PeakRss() as mem:
            res = eng.submit_upload(path, url, crc32c=crc).result()
    assert res.crc32c == crc and res.size == size
    assert open_store(url).stat(url).size == size
    grew = mem.grew
    assert grew < 96 * 1024 * 1024, f"RSS grew by {grew / 2**20:.0f} MiB uploading a {size >> 20} MiB file by name"
