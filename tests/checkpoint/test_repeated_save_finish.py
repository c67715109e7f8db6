"""A repeated save's DCP finish on rank 0 costs O(R), not O(R x T): each rank sends only
a digest of its write results when they are those of its last completed save, and rank
0 reuses the `.metadata` it wrote then (dcp/writer.py). Real gloo ranks; every step's
`.metadata` is checked by stock DCP loading the step, bit for bit."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cloudckpt.testing.multiprocess import run_ranks

from . import finish_workers as w

R = 2


def _stock_load(step_dir: str, step: int, extra: bool) -> None:
    """Stock DCP (FileSystemReader, no cloudckpt) loads the step's model_and_optim folder."""
    want = w.full(w.state_single(step, extra))
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    nested: dict = {}
    for k, v in got.items():
        top, name = k.split(".", 1)
        nested.setdefault(top, {})[name] = v
    dcp.load(nested, storage_reader=dcp.FileSystemReader(os.path.join(step_dir, "model_and_optim")), no_dist=True)
    for k, v in want.items():
        assert torch.equal(nested[k.split(".", 1)[0]][k.split(".", 1)[1]], v), (step, k)


@pytest.mark.parametrize("fail_step,keep", [(None, None), (None, 0), (3, 0)],
                         ids=["pickled again", "kept and linked", "kept; rank 1 fails step 3's write"])
def test_a_repeated_save_sends_digests_and_reuses_the_metadata_which_stock_dcp_loads(tmp_path, fail_step, keep):
    root = str(tmp_path / "run")
    work = str(tmp_path / "work")
    res = run_ranks(R, w.saves, root, work, fail_step, keep, timeout=600)
    assert os.listdir(work) == []  # close() removed rank 0's folder
    on0 = res[0]
    for save in on0:
        # rank 0 keeps a .metadata at or over KEEP_METADATA_BYTES in a private folder of its own
        # (removed by close); a smaller one leaves nothing in work_dir (the ranks share it here, so
        # another rank's step folder may still be there)
        kept = [n for n in save["work_dir"] if n.startswith("dcp-metadata-")]
        assert len(kept) == (1 if keep == 0 else 0), save
    ok = {r["step"]: r["ok"] for r in on0}
    assert ok == {s: s != fail_step for s in range(1, 6)}, ok
    digest_only = {r["step"]: r["digest_only"] for r in on0}
    assert digest_only[1] == [False] * R  # a job's first save: the results whole
    if fail_step is None:
        assert digest_only[2] == digest_only[3] == digest_only[4] == [True] * R  # the same results: digests only
    else:
        assert digest_only[2] == [True] * R
        assert digest_only[3] is None  # rank 1's write failed: no finish
        assert digest_only[4] == [False] * R  # after a failed save, every rank sends its results whole
    assert digest_only[5] == [False] * R  # a new tensor: the plan and the results changed
    metas = {s: open(os.path.join(root, f"step{s}", "model_and_optim", ".metadata"), "rb").read()
             for s in range(1, 6) if ok[s]}
    first = metas[1]
    for s in (2, 3, 4) if fail_step is None else (2,):
        assert metas[s] == first, s  # reused (linked), not rebuilt
    assert metas[5] != first
    for s, committed in ok.items():
        if committed:
            _stock_load(os.path.join(root, f"step{s}"), s, extra=s == 5)
    _inspect_matches_stock(os.path.join(root, "step5"))
    _export_reads_the_index(os.path.join(root, "step5"), str(tmp_path / "model.safetensors"))
    _verify_checks_the_index(os.path.join(root, "step4"))


def _inspect_matches_stock(step_dir: str) -> None:
    """``cloudckpt inspect`` describes the step from the DCP index header (never reading
    ``.metadata``, 1.6 GB at 4,096 ranks): the same keys, dtypes, shapes and chunk counts
    as stock DCP reads from ``.metadata``."""
    from cloudckpt.ops.inspect import inspect_step

    md = dcp.FileSystemReader(os.path.join(step_dir, "model_and_optim")).read_metadata()
    want = {k: (str(m.properties.dtype).removeprefix("torch."), list(m.size), len(m.chunks))
            for k, m in md.state_dict_metadata.items() if hasattr(m, "chunks")}
    with _opened() as read:
        rep = inspect_step(step_dir)
    assert {t["key"]: (t["dtype"], t["shape"], t["chunks"]) for t in rep.tensors} == want
    assert max(c for *_, c in want.values()) == R  # sharded tensors: a chunk per rank
    assert rep.non_tensor_keys == sorted(k for k, m in md.state_dict_metadata.items() if not hasattr(m, "chunks"))
    assert not [u for u in read if u.endswith("/.metadata")] and any(u.endswith("index/header.json") for u in read)


def test_digests_the_coordinator_does_not_hold_fail_the_save_with_a_typed_error(tmp_path):
    # a rank's last save completed but the coordinator's finish of it did not (a failure between
    # the ranks): a digest alone cannot be merged, the save fails, and the next sends results whole
    from torch.distributed.checkpoint.metadata import Metadata

    from cloudckpt.dcp.writer import RankResults, UploadingWriter
    from cloudckpt.errors import SaveFailed

    cache: dict = {}
    writer = UploadingWriter(str(tmp_path / "m"), lambda *a: None, index_cache=cache, cache_dir=lambda: str(tmp_path))
    with pytest.raises(SaveFailed, match="rank 1 sent the digest"):
        writer.finish(Metadata(state_dict_metadata={}), [RankResults(b"a" * 16, []), RankResults(b"b" * 16, None)])
    writer.abandoned()
    assert cache == {}


def _kept_metadata_saves(any_root: str, monkeypatch):
    """``(root, store, state, meta)`` for repeated saves in which every ``.metadata`` is kept
    (as a large job's): ``meta(s)`` is step ``s``'s ``.metadata`` URL."""
    from cloudckpt.checkpoint import layout
    from cloudckpt.dcp import writer as dcp_writer
    from cloudckpt.storage import open_store

    monkeypatch.setattr(dcp_writer, "KEEP_METADATA_BYTES", 0)
    root = any_root.rstrip("/")
    return root, open_store(root), w.state_single(1), lambda s: f"{root}/step{s}/{layout.DCP_METADATA}"


def test_a_reused_metadata_is_copied_server_side_and_uploaded_when_its_source_is_gone(any_root, tmp_path,
                                                                                       monkeypatch, caplog):
    # rank 0 of a large job would upload the same ~1.6 GB .metadata at every save (4,096 ranks of a
    # 70B model): a repeated save copies the last step's object in the store instead, checked by size
    # (and CRC32C where the store reports it); the source gone, the file is uploaded, and said so
    import logging

    from cloudckpt import Checkpointer

    root, store, sd, meta = _kept_metadata_saves(any_root, monkeypatch)
    moved = []
    with Checkpointer(work_dir=str(tmp_path / "work")) as ck:
        for s in (1, 2, 3):
            before = ck.engine.stats()
            ck.save(f"{root}/step{s}", sd)
            after = ck.engine.stats()
            moved.append((after.bytes_uploaded - before.bytes_uploaded, after.bytes_copied - before.bytes_copied))
        size = store.stat(meta(1)).size
        assert moved[0][1] == 0 and moved[0][0] > size  # the first save uploads every file, .metadata included
        for up, copied in moved[1:]:
            assert copied == size and up == moved[0][0] - size, moved  # the rest as before: shards, index
        first = store.get_bytes(meta(1))
        assert store.get_bytes(meta(2)) == store.get_bytes(meta(3)) == first
        store.delete(meta(3))  # the copy's source is gone (a user removed it): uploaded, and logged
        before = ck.engine.stats()
        with caplog.at_level(logging.INFO, logger="cloudckpt.transfer.engine"):
            ck.save(f"{root}/step4", sd)
        after = ck.engine.stats()
        assert after.bytes_copied == before.bytes_copied and after.bytes_uploaded - before.bytes_uploaded == moved[0][0]
        assert any("not copied from" in r.getMessage() and "uploading" in r.getMessage() for r in caplog.records)
        assert store.get_bytes(meta(4)) == first
        got = w.state_single(0)
        ck.load(f"{root}/step2", got)
        assert all(torch.equal(a, b) for a, b in zip(w.full(got).values(), w.full(sd).values(), strict=True))


def _verify_checks_the_index(step_dir: str) -> None:
    """``cloudckpt verify`` parses what a load parses, the DCP index rank by rank; a
    ``.metadata`` too large to unpickle on a laptop (here: any) is checked by size and
    CRC32C and said so; a part that lacks a chunk the header gives its rank is BAD."""
    import json

    from cloudckpt.ops import verify as verify_mod

    rep = verify_mod.verify_step(step_dir)
    assert rep.ok and rep.notes == [], rep.bad  # a small .metadata is parsed (and agrees with the index)
    real = verify_mod.PARSE_METADATA_BYTES
    verify_mod.PARSE_METADATA_BYTES = 0
    try:
        rep = verify_mod.verify_step(step_dir)
        assert rep.ok and [n["path"] for n in rep.notes] == ["model_and_optim/.metadata"], rep.notes
        assert "not parsed" in rep.notes[0]["detail"]
        part = os.path.join(step_dir, "index", "rank1.json")
        doc = json.loads(open(part, "rb").read())
        doc["items"] = doc["items"][1:]  # a chunk of rank 1 gone; the manifest made to match
        body = json.dumps(doc).encode()
        open(part, "wb").write(body)
        _relist(step_dir, "index/rank1.json", body)
        rep = verify_mod.verify_step(step_dir)
        assert [b["path"] for b in rep.bad] == ["index/rank1.json"], rep.bad
        assert "lacks the chunk" in rep.bad[0]["detail"]
    finally:
        verify_mod.PARSE_METADATA_BYTES = real


def _relist(step_dir: str, rel: str, body: bytes) -> None:
    """The step's manifest entry of ``rel`` made to match ``body`` (as an attacker with the
    bucket would): only the parse checks can tell."""
    from security.corpus import Step

    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls
    from cloudckpt.transfer.checksum import crc32c_bytes

    Step(open_store(step_dir), step_dir, urls.join).relist(rel, len(body), crc32c_bytes(body))


def _export_reads_the_index(step_dir: str, dest: str) -> None:
    """``cloudckpt export`` plans from the DCP index (the header, then the parts of the
    ranks that wrote the model's chunks), never ``.metadata``: the file holds every
    tensor of the model, whole, bit for bit."""
    from safetensors.torch import load_file

    from cloudckpt.ops.export import export_weights

    with _opened() as read:
        export_weights(step_dir, dest)
    want = {k.removeprefix("model."): v for k, v in w.full(w.state_single(5, extra=True)).items()
            if k.startswith("model.")}
    got = load_file(dest)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not [u for u in read if u.endswith("/.metadata")]
    assert {u.rsplit("/", 1)[-1] for u in read if "/index/" in u} == {"header.json", "rank0.json", "rank1.json"}


@contextlib.contextmanager
def _opened():
    """The URLs every read of a local store opens meanwhile (``LocalStore._open``)."""
    from cloudckpt.storage.local import LocalStore

    real_open = LocalStore._open
    read: list[str] = []

    def opened(self, url, *a, **kw):
        read.append(url)
        return real_open(self, url, *a, **kw)

    LocalStore._open = opened
    try:
        yield read
    finally:
        LocalStore._open = real_open


@pytest.mark.parametrize("bytes_", ["other", "same"])
def test_a_repeated_save_never_copies_a_metadata_someone_replaced_between_saves(any_root, tmp_path, monkeypatch,
                                                                                caplog, bytes_):
    # the copy's source is the previous step's .metadata, in a bucket others may write: replaced between the two
    # saves by bytes of the same size (or by the same bytes, written again), the store's version of it is no
    # longer the one rank 0 got when it wrote it, so the copy is refused by the store and the file uploaded
    # (a warning): the new step holds rank 0's bytes and its manifest's CRC32C is theirs
    import logging

    from cloudckpt import Checkpointer
    from cloudckpt.checkpoint import layout
    from cloudckpt.transfer import crc32c_bytes

    root, store, sd, meta = _kept_metadata_saves(any_root, monkeypatch)
    with Checkpointer(work_dir=str(tmp_path / "work")) as ck:
        ck.save(f"{root}/step1", sd)
        ours = store.get_bytes(meta(1))
        theirs = bytes(b ^ 0xFF for b in ours) if bytes_ == "other" else ours
        store.put_bytes(meta(1), theirs)  # another writer, between the two saves
        before = ck.engine.stats()
        with caplog.at_level(logging.INFO, logger="cloudckpt.transfer.engine"):
            marker = ck.save(f"{root}/step2", sd)
        after = ck.engine.stats()
        warned = [r for r in caplog.records if "not copied from" in r.getMessage()]
        if bytes_ == "same" and any_root.startswith("s3://"):
            # S3's ETag of a single-part object is the MD5 of its bytes: the same bytes written again have the
            # version rank 0 got, and copying them copies exactly what it wrote
            assert after.bytes_copied - before.bytes_copied == len(ours) and not warned
        else:
            assert after.bytes_copied == before.bytes_copied, "copied from an object rank 0 did not write"
            assert warned and warned[0].levelno == logging.WARNING and meta(1) in warned[0].getMessage()
        assert store.get_bytes(meta(2)) == ours
        assert marker.object(layout.DCP_METADATA).crc32c == crc32c_bytes(ours)
        caplog.clear()
        ck.save(f"{root}/step3", sd)  # what it uploaded is its own again: the next save copies it
        assert ck.engine.stats().bytes_copied - after.bytes_copied == len(ours)
        assert store.get_bytes(meta(3)) == ours
