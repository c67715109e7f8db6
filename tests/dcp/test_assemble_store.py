"""DCP's ``.metadata`` joined in the store from every rank's fragment
(cloudckpt/dcp/assemble_store.py) on 4 real gloo ranks: a local folder (one piece per
rank, written at offsets), SeaweedFS (pieces of 5 MiB at least: ranks send their
fragments to the first rank of their run, which uploads it as one part) and
fake-gcs-server (one component per rank, composed). The object unpickles to the
Metadata the fragments came from; a failed complete leaves nothing behind."""

from __future__ import annotations

import os
import pickle
import zlib

import google_crc32c
import pytest
import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from cloudckpt.dcp.assemble import TRAILER, fragment, header
from cloudckpt.dcp.assemble_store import Run, crc32c_combine, runs
from cloudckpt.storage.url import parse_url
from cloudckpt.testing.multiprocess import RankFailed, run_ranks

KEYS = 14_000  # about 13 MiB of .metadata: 3-4 MiB per rank of 4, so S3's 5 MiB parts take two ranks each


def synthetic(keys: int = KEYS) -> Metadata:
    """A Metadata of ``keys`` tensors in 4 row chunks each, and their storage entries."""
    from cloudckpt._torch_compat import StorageInfo

    sdm, storage = {}, {}
    props = TensorProperties(dtype=torch.bfloat16)
    for k in range(keys):
        fqn = f"model.layers.{k // 16}.mlp.w{k % 16}"
        chunks = [ChunkStorageMetadata(torch.Size([4 * j, 0]), torch.Size([4, 64])) for j in range(4)]
        sdm[fqn] = TensorStorageMetadata(props, torch.Size([16, 64]), chunks)
        for j, c in enumerate(chunks):
            storage[MetadataIndex(fqn, c.offsets, j)] = StorageInfo(f"__{j}_0.distcp", 512 * k, 512)
    return Metadata(sdm, {fqn: tuple(fqn.split(".")) for fqn in sdm}, storage, None, CURRENT_DCP_VERSION)


def share(md: Metadata, rank: int, world: int) -> bytes:
    def mine(fqn):
        return zlib.crc32(fqn.encode()) % world == rank

    return fragment(state_dict_metadata=[(k, v) for k, v in md.state_dict_metadata.items() if mine(k)],
                    planner_data=[(k, v) for k, v in md.planner_data.items() if mine(k)],
                    storage_data=[(k, v) for k, v in md.storage_data.items() if mine(k.fqn)])


def _assemble(rank: int, world: int, urls: list[str], if_absent: bool) -> list:
    from cloudckpt.dcp.assemble_store import assemble_in_store
    from cloudckpt.dist import Coordinator
    from cloudckpt.storage import open_store

    coord = Coordinator(timeout=120)
    frag = share(synthetic(), rank, world)
    out = []
    for url in urls:
        info = assemble_in_store(coord, open_store(url), url, frag, header=header(), trailer=TRAILER,
                                 if_absent=if_absent)
        out.append((info.size, len(frag), info.crc32c))
    return out


@pytest.fixture(scope="module")
def expected() -> Metadata:
    return synthetic()


def test_metadata_joined_in_three_stores_by_four_ranks_unpickles_to_the_whole(tmp_path, s3_bucket, seaweed,
                                                                               gcs_bucket, fake_gcs, expected):
    from cloudckpt.storage import open_store
    from cloudckpt.untrusted import loads_metadata

    urls = [str(tmp_path / "step1" / ".metadata"), s3_bucket + "/step1/.metadata", gcs_bucket + "/step1/.metadata"]
    got = run_ranks(4, _assemble, urls, False, env={**seaweed.env(), **fake_gcs.env()})
    frag_sizes = [r[0][1] for r in got]
    assert min(frag_sizes) > 2 * 2**20 and max(frag_sizes) < 5 * 2**20  # S3 needs two ranks per part
    for k, url in enumerate(urls):
        data = open_store(url).get_bytes(url)
        # every rank was told the object's size and CRC32C (combined from the pieces': nobody read it back)
        assert {(r[k][0], r[k][2]) for r in got} == {(len(data), f"{google_crc32c.value(data):08x}")}
        md = pickle.loads(data)
        assert md == expected and md.storage_data == expected.storage_data
        assert loads_metadata(data, url=url) == expected
    assert os.listdir(tmp_path / "step1") == [".metadata"]  # no temporary file left
    p = parse_url(urls[1])
    etag = open_store(urls[1]).client.head_object(Bucket=p.bucket, Key=p.key)["ETag"].strip('"')
    assert etag.endswith("-2")  # two parts of two ranks each
    assert [e.url for e in open_store(urls[2]).list(gcs_bucket + "/", delimiter=None)] == [urls[2]]


def test_a_complete_refused_raises_on_every_rank_and_leaves_no_upload(s3_bucket, seaweed):
    from cloudckpt.storage import open_store

    url = s3_bucket + "/step2/.metadata"
    store = open_store(url)
    store.put_bytes(url, b"someone else's")
    with pytest.raises(RankFailed) as ei:
        run_ranks(2, _assemble, [url], True, env=seaweed.env())
    assert set(ei.value.failures) == {0, 1}
    assert all("AlreadyExists" in tb for tb in ei.value.failures.values())
    assert store.get_bytes(url) == b"someone else's"
    assert store.list_multipart_uploads(s3_bucket + "/") == []


@pytest.mark.parametrize("sizes, min_piece, max_pieces, expect", [
    ([3, 3, 3, 3], 5, None, [(0, 2, 0, 6), (2, 4, 6, 6)]),
    ([6, 0, 1, 0], 5, None, [(0, 1, 0, 6), (1, 4, 6, 1)]),  # the last run may be small
    ([1, 2, 0], 0, None, [(0, 1, 0, 1), (1, 3, 1, 2)]),  # no least piece: a run per rank with bytes
    ([0, 0], 5, None, [(0, 2, 0, 0)]),
    ([4] * 10, 0, 2, [(0, 5, 0, 20), (5, 10, 20, 20)]),  # at most max_pieces
])
def test_runs_reach_the_least_piece_but_the_last_and_cover_every_rank_once(sizes, min_piece, max_pieces, expect):
    got = runs(sizes, min_piece=min_piece, max_pieces=max_pieces)
    assert [(r.first, r.end, r.offset, r.size) for r in got] == expect
    assert [r.index for r in got] == list(range(len(got))) and isinstance(got[0], Run)


def test_fragments_of_a_large_metadata_are_about_the_size_of_stock_dcps_pickle():
    """8,000 tensors of 4 chunks: the fragments of 4 owners, with the header and trailer,
    against ``pickle.dumps`` of the same Metadata (stock DCP's protocol 4, which
    memoises every object)."""
    md = synthetic(8000)
    ours = len(header()) + sum(len(share(md, r, 4)) for r in range(4)) + len(TRAILER)
    stock = len(pickle.dumps(md))
    assert 1.0 < ours / stock < 1.25


def test_one_process_joins_the_metadata_alone_and_a_cut_one_is_refused_as_corrupt(tmp_path, expected):
    """Without a process group every step is local: one piece, the whole Metadata. The
    same bytes cut short (what a half-assembled object would hold, were it visible) are
    refused by the untrusted reader as corrupt, never half-read."""
    from cloudckpt.dcp.assemble_store import assemble_in_store
    from cloudckpt.dist import Coordinator
    from cloudckpt.errors import CorruptCheckpoint
    from cloudckpt.storage import open_store
    from cloudckpt.untrusted import loads_metadata

    md = synthetic(300)
    url = str(tmp_path / ".metadata")
    info = assemble_in_store(Coordinator(local=True), open_store(url), url, share(md, 0, 1), header=header(),
                             trailer=TRAILER)
    data = open_store(url).get_bytes(url)
    assert info.size == len(data) and pickle.loads(data) == md and os.listdir(tmp_path) == [".metadata"]
    for cut in (len(header()), len(data) // 2, len(data) - len(TRAILER)):
        with pytest.raises(CorruptCheckpoint):
            loads_metadata(data[:cut], url=url)


@pytest.mark.parametrize("n1, n2", [(0, 0), (0, 5), (5, 0), (1, 1), (100, 1000), (7, 3_000_001)])
def test_crc32c_combined_from_two_parts_is_the_crc32c_of_the_whole(n1, n2):
    a, b = os.urandom(n1), os.urandom(n2)
    assert crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), n2) == google_crc32c.value(a + b)
    assert crc32c_combine(zlib.crc32(a), zlib.crc32(b), n2, poly=0xEDB88320) == zlib.crc32(a + b)  # zlib's CRC-32


def test_crc32c_combined_over_pieces_of_one_size_uses_that_lengths_operator_and_stays_exact():
    """An assembly's pieces are mostly of one size: from the second piece of a length on,
    its own operator (composed once) advances the CRC; the CRC32C and zlib's CRC-32 of
    the whole are exact at every piece, for several sizes interleaved."""
    whole_c, whole_z, c, z = b"", b"", 0, 0
    for i in range(12):
        piece = os.urandom((1000, 4099, 1000, 65_536)[i % 4])
        c = crc32c_combine(c, google_crc32c.value(piece), len(piece))
        z = crc32c_combine(z, zlib.crc32(piece), len(piece), poly=0xEDB88320)
        whole_c, whole_z = whole_c + piece, whole_z + piece
        assert c == google_crc32c.value(whole_c) and z == zlib.crc32(whole_z), i


def test_crc32c_combined_over_thousands_of_pieces_is_the_crc32c_of_the_whole():
    """What the coordinator does once per piece of a job's ``.metadata`` (one piece a rank
    in a store without a least piece: 16,384 at 16,384 ranks), with the operators cached
    across calls and pieces of every length from 0 to 64 KiB."""
    import random

    data = os.urandom(1 << 22)
    rng = random.Random(7)
    cuts = sorted({0, len(data), *(rng.randrange(len(data)) for _ in range(4095))})
    crc = 0
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        crc = crc32c_combine(crc, google_crc32c.value(data[lo:hi]), hi - lo)
    assert crc == google_crc32c.value(data) and len(cuts) > 4000
