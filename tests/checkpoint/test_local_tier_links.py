"""Links planted in the local folders cloudckpt works in are never followed: the node-local
tier's folder (copies received from peers, recovery, retention, the run file),
pre-download files and the per-rank work dirs. The levels of ``local_dir`` one by one,
through save, retention and resume, are the tries of tests/security/hostile_links.py
(run in the sandbox by tests/security/test_hostile.py); here: the building blocks, the
run file's contents, the user's own links, and 4 real gloo ranks as 2 nodes."""

from __future__ import annotations

import os
import shutil
import stat
import threading

import pytest
import torch

from cloudckpt.checkpoint.local import parts
from cloudckpt.dcp import predownload as P
from cloudckpt.errors import ConfigError, StorageError, UnsafeCheckpoint
from cloudckpt.storage import nofollow
from cloudckpt.storage.nofollow import Folder
from cloudckpt.testing.multiprocess import run_ranks

from . import local_workers
from .test_checkpointer import _env
from .test_local_tier import _equal


@pytest.fixture
def outside(tmp_path):
    """A folder with a file and a subfolder that nothing may change."""
    out = tmp_path / "outside"
    (out / "sub").mkdir(parents=True)
    (out / "victim").write_bytes(b"planted victim\n")
    (out / "sub" / "keep.bin").write_bytes(b"x" * 10)
    return out


def _tree(path) -> dict:
    out = {}
    for d, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[p] = os.readlink(p) if os.path.islink(p) else (open(p, "rb").read() if os.path.isfile(p) else "dir")
    return out


# ----------------------------------------------------------------- nofollow.Folder
def test_a_folder_never_opens_reads_or_removes_through_a_link(tmp_path, outside):
    before = _tree(outside)
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f").write_bytes(b"mine")
    os.symlink(outside, root / "a" / "dirlink")
    os.symlink(outside / "victim", root / "a" / "filelink")
    os.mkfifo(root / "a" / "fifo")
    with Folder.open(str(root), what="local_dir") as r:
        with pytest.raises(UnsafeCheckpoint, match=r"a/dirlink is a symbolic link \(to '.*outside'\) inside local_dir"):
            r.folder("a/dirlink/sub")
        with pytest.raises(UnsafeCheckpoint, match="a/filelink is a symbolic link"):
            r.read("a/filelink", limit=100)
        with pytest.raises(UnsafeCheckpoint, match="not a regular file"):  # never opened blocking
            r.read("a/fifo", limit=100)
        with pytest.raises(UnsafeCheckpoint, match="climbs out"):
            r.read("a/../a/f", limit=100)
        assert r.read("a/f", limit=2) == b"min"  # at most limit + 1 bytes
        with pytest.raises(UnsafeCheckpoint):
            r.file_stat("a/dirlink/keep")
        assert r.file_stat("a/f").st_size == 4 and r.file_stat("a/missing") is None
        with r.folder("a") as a:
            with pytest.raises(UnsafeCheckpoint):
                a.touch("filelink")
            with pytest.raises(UnsafeCheckpoint):  # O_EXCL: never opened
                a.new_file("filelink")
            with pytest.raises(FileExistsError):
                a.new_file("f")
            a.write("filelink", b"replaced")  # the link itself is replaced
            assert not os.path.islink(root / "a" / "filelink")
            a.remove("dirlink")  # the link, not its target
        r.remove("a")  # a folder: walked by fd
    assert not (root / "a").exists()
    assert _tree(outside) == before
    with pytest.raises(UnsafeCheckpoint):  # the resolved root opened from "/": a link on the way is refused
        os.symlink(root, tmp_path / "rootlink")
        Folder.open(str(tmp_path / "rootlink"))


def test_a_file_is_linked_or_copied_from_what_was_checked(tmp_path, outside):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "d").mkdir(parents=True)
    dst.mkdir()
    (src / "d" / "f").write_bytes(b"data")
    os.symlink(outside / "victim", src / "d" / "l")
    with Folder.open(str(src)) as s, Folder.open(str(dst)) as d:
        s.link_file("d/f", d, "f")
        assert (dst / "f").read_bytes() == b"data" and os.stat(dst / "f").st_ino == os.stat(src / "d" / "f").st_ino
        with pytest.raises(UnsafeCheckpoint):
            s.link_file("d/l", d, "l")
    assert not os.path.lexists(dst / "l")


# ----------------------------------------------------------------- work dirs
def _foreign(path, monkeypatch) -> None:
    """``path`` becomes another user's (chown when root; else cloudckpt is told this
    process is another user: the same check either way)."""
    if os.geteuid() == 0:
        os.lchown(path, 4242, 4242)
    else:
        real = os.geteuid()
        monkeypatch.setattr(nofollow, "_euid", lambda: real + 1)


def test_a_work_dir_is_private_and_one_of_another_user_is_refused(tmp_path, outside, monkeypatch):
    base = tmp_path / "scratch" / "work"
    made = nofollow.private_dir(str(base), "step1-rank0-")
    assert os.path.dirname(made) == str(base) and os.path.basename(made).startswith("step1-rank0-")
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o700 and stat.S_IMODE(os.stat(made).st_mode) == 0o700
    # the user's own link (and links above the work dir) are followed
    os.symlink(base, tmp_path / "mine")
    assert os.path.dirname(nofollow.private_dir(str(tmp_path / "mine"), "x-")) == str(base)
    before = _tree(outside)
    planted = tmp_path / "tmp2"
    planted.mkdir()
    os.symlink(outside, planted / "cloudckpt-work-1000")
    _foreign(planted / "cloudckpt-work-1000", monkeypatch)
    with pytest.raises(ConfigError,
                       match=r"is a symbolic link made by another user .*set work_dir to a folder you own"):
        nofollow.private_dir(str(planted / "cloudckpt-work-1000"), "load-rank0-")
    squatted = planted / "squatted"
    squatted.mkdir(mode=0o777)
    _foreign(squatted, monkeypatch)
    with pytest.raises(ConfigError, match="is a folder owned by another user"):
        nofollow.private_dir(str(squatted), "load-rank0-")
    assert _tree(outside) == before and os.listdir(squatted) == []


def test_a_pre_download_file_is_never_opened_through_what_is_planted_in_its_place(tmp_path, outside):
    before = _tree(outside)
    dl_dir = tmp_path / "dl"
    dl_dir.mkdir()
    os.symlink(outside / "victim", dl_dir / "obj0-at0")
    (dl_dir / "obj1-at0").write_bytes(b"planted")
    shared = threading.Condition()
    with pytest.raises(UnsafeCheckpoint, match="obj0-at0 is a symbolic link"):
        P.FileDownload(shared, "__0_0.distcp", "s3://b/x", str(dl_dir / "obj0-at0"), [(0, 10, "all")])
    with pytest.raises(StorageError, match="obj1-at0 already exists"):
        P.FileDownload(shared, "__0_0.distcp", "s3://b/x", str(dl_dir / "obj1-at0"), [(0, 10, "all")])
    assert (dl_dir / "obj1-at0").read_bytes() == b"planted" and _tree(outside) == before


# ----------------------------------------------------------------- the tier, one process
def _cfg(tmp_path, local, **kw):
    from cloudckpt import CheckpointConfig

    opts = dict(save_folder=str(tmp_path / "run"), local_dir=str(local), local_save_interval=1, keep_last_local=2,
                work_dir=str(tmp_path / "w"), exact_resume=False)
    opts.update(kw)
    return CheckpointConfig(**opts)


def test_the_users_own_links_to_and_above_local_dir_are_followed(tmp_path):
    real = tmp_path / "nvme" / "ckpt"
    real.mkdir(parents=True)
    os.symlink(tmp_path / "nvme", tmp_path / "fast")  # a link above local_dir
    os.symlink(tmp_path / "fast" / "ckpt", tmp_path / "local")  # local_dir itself a link
    cfg = _cfg(tmp_path, tmp_path / "local")
    with cfg.build() as mgr:
        for s in (1, 2, 3):
            mgr.maybe_save(s, {"w": torch.full((4,), float(s))}, {"step": s})
        mgr.wait()
    assert parts.steps_on_disk(str(real)) == [2, 3]
    with cfg.build() as mgr:
        sd = {"w": torch.zeros(4)}
        assert mgr.resume(sd) == {"step": 3} and mgr.resumed_from == "local"
        assert torch.equal(sd["w"], torch.full((4,), 3.0))
    assert not [n for n in os.listdir(real) if n.startswith(".tmp-")]  # the recovery's view is gone


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,  # deep: a RecursionError before
    b'{"save_folder": Infinity}',
    b'{"save_folder": ' + b"1" * 5000 + b"}",
    b'["not", "an", "object"]',
    b'{"save_folder": "x"}' + b" " * (1 << 20),  # over the 64 KiB cap
    b"\xff\xfe not json",
], ids=["deep", "infinity", "long-int", "not-object", "huge", "binary"])
def test_a_bad_run_file_is_replaced_in_an_empty_folder_and_refused_beside_steps(tmp_path, body):
    local = tmp_path / "local"
    local.mkdir()
    run_file = local / ".cloudckpt-run.json"
    run_file.write_bytes(body)
    with _cfg(tmp_path, local).build() as mgr:  # no steps: the folder is claimed
        mgr.maybe_save(1, {"w": torch.ones(2)})
    assert b"save_folder" in run_file.read_bytes() and len(run_file.read_bytes()) < 1000
    run_file.write_bytes(body)
    with pytest.raises(ConfigError, match=r"holds local steps, and its run file, .* cannot be used \(.*run file"):
        _cfg(tmp_path, local).build()
    assert run_file.read_bytes() == body  # left for the user to look at


def test_a_run_file_that_is_a_fifo_or_a_folder_is_never_opened_blocking(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    os.mkfifo(local / ".cloudckpt-run.json")
    with _cfg(tmp_path, local).build() as mgr:  # no steps: replaced by this run's file
        mgr.maybe_save(1, {"w": torch.ones(2)})
    assert (local / ".cloudckpt-run.json").is_file()
    (local / ".cloudckpt-run.json").unlink()
    (local / ".cloudckpt-run.json").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        _cfg(tmp_path, local).build()


# ----------------------------------------------------------------- 4 ranks as 2 nodes
WORLD = 4


def _run(s3_bucket, tmp_path, upto, **kw):
    env = dict(_env(), LOCAL_WORLD_SIZE="2")
    return run_ranks(WORLD, local_workers.run, s3_bucket + "/run", str(tmp_path / "local"), str(tmp_path / "work"),
                     upto, kw.get("cfg_kw"), None, env=env, timeout=kw.get("timeout", 240))


def test_copies_from_peers_retention_and_recovery_never_follow_planted_links(s3_bucket, tmp_path, outside):
    """Node 1's folder holds, before the run, a real step20 folder with ``rank0 -> X``
    (where the copy of rank 0's part lands) and ``rank2 -> X`` (rank 2's own part), a
    ``step1 -> X`` that retention prunes, and ``.tmp-* -> X``. The run replaces the part
    links with real parts and removes step1's link, X untouched. Then node 1 is
    replaced by a disk holding only ``step30 -> X``: its ranks recover step 30 from
    node 0 (the recovery's view is not made in the linked step folder)."""
    before = _tree(outside)
    node1 = tmp_path / "local" / "node1"
    (node1 / "step20").mkdir(parents=True)
    for at in ("step20/rank0", "step20/rank2", "step1", ".tmp-view2-planted"):
        os.symlink(outside / "sub", node1 / at)
    outs = _run(s3_bucket, tmp_path, 30)
    snaps = outs[0]["snapshots"]
    assert _tree(outside) == before
    assert not os.path.lexists(node1 / "step1"), "retention removes the link itself"
    for part in ("rank0", "rank1", "rank2", "rank3"):
        st = os.lstat(node1 / "step20" / part)
        assert stat.S_ISDIR(st.st_mode) and (node1 / "step20" / part / "part.json").is_file(), part
    shutil.rmtree(node1)
    node1.mkdir()
    os.symlink(outside / "sub", node1 / "step30")
    outs = _run(s3_bucket, tmp_path, 30)
    for r, o in enumerate(outs):
        assert (o["resumed_from"], o["resumed_step"]) == ("local", 30), r
        assert _equal(o["at_resume"], snaps[30]), r
    assert outs[2]["recovery"]["fetched_bytes"] > 0 and outs[3]["recovery"]["fetched_bytes"] > 0
    assert _tree(outside) == before
    assert os.path.islink(node1 / "step30") and not [n for n in os.listdir(node1) if n.startswith(".tmp-")]
