"""The local backend never follows a symbolic link at any component of a path.

A save folder on a shared disk may hold links planted by someone else. Each test
plants links under ``save/`` that point at sentinel files outside it, runs the
operation, and checks that nothing outside changed (content and existence).
"""

from __future__ import annotations

import io
import logging
import os

import pytest

from cloudckpt.errors import AlreadyExists, NotFound, PreconditionFailed, UnsafeCheckpoint
from cloudckpt.storage import resolve_local, resolve_step_dir
from cloudckpt.storage.local import LocalStore


def _tree(root) -> dict:
    """Every entry under ``root`` (links not followed): relpath -> bytes, 'dir' or 'link:<target>'."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as f:
                    out[rel] = f.read()
    return out


@pytest.fixture
def env(tmp_path):
    """save/ (a real step1 with one object) and outside/ (sentinels), plus a helper that
    asserts outside/ is exactly as planted."""
    save, outside = tmp_path / "save", tmp_path / "outside"
    (save / "step1").mkdir(parents=True)
    (save / "step1" / "model.bin").write_bytes(b"model")
    (outside / "sub").mkdir(parents=True)
    (outside / "a.bin").write_bytes(b"sentinel-a")
    (outside / "sub" / "b.bin").write_bytes(b"sentinel-b")
    (outside / "latest").write_bytes(b"step-outside")
    before = _tree(outside)

    class Env:
        store = LocalStore()

        def __init__(self):
            self.save, self.outside, self.tmp = save, outside, tmp_path

        def p(self, *parts) -> str:
            return os.path.join(str(save), *parts)

        def untouched(self):
            assert _tree(outside) == before

    return Env()


# ------------------------------------------------------------ a link as a step folder
@pytest.fixture
def step_link(env):
    os.symlink(env.outside, env.save / "step99")
    return env


def test_listing_reports_a_linked_step_folder_as_an_object_and_warns(step_link, caplog):
    env = step_link
    with caplog.at_level(logging.WARNING, logger="cloudckpt.storage.local"):
        flat = list(env.store.list(env.p() + "/"))
        deep = list(env.store.list(env.p() + "/", delimiter=None))
        walked = [o.url for o in env.store.walk(env.p() + "/")]
    assert [(e.url, e.is_prefix) for e in flat] == [(env.p("step1/"), True), (env.p("step99"), False)]
    assert [(e.url, e.is_prefix) for e in deep] == [(env.p("step1", "model.bin"), False), (env.p("step99"), False)]
    assert walked == [env.p("step1", "model.bin"), env.p("step99")]  # the link itself, nothing of its target
    assert sum("symbolic link" in r.getMessage() and "step99" in r.getMessage() for r in caplog.records) == 3
    # the file:// form is kept
    listed = [e.url for e in env.store.list("file://" + env.p() + "/")]
    assert listed == ["file://" + env.p("step1/"), "file://" + env.p("step99")]
    env.untouched()


def test_listing_inside_a_linked_step_folder_is_refused(step_link):
    env = step_link
    for delimiter in ("/", None):
        with pytest.raises(UnsafeCheckpoint, match="step99 is a symbolic link.*does not follow links"):
            list(env.store.list(env.p("step99") + "/", delimiter=delimiter))
    env.untouched()


def test_delete_prefix_of_the_save_folder_removes_the_link_not_its_target(step_link):
    env = step_link
    assert env.store.delete_prefix(env.p() + "/") == 2  # step1/model.bin and the link
    assert not os.path.lexists(env.p("step99")) and not env.save.exists()
    env.untouched()


def test_delete_prefix_of_a_linked_step_folder_is_refused(step_link):
    env = step_link
    with pytest.raises(UnsafeCheckpoint, match="step99"):
        env.store.delete_prefix(env.p("step99") + "/")
    assert os.path.islink(env.p("step99"))
    env.untouched()


def test_a_link_inside_a_step_folder_is_deleted_as_itself(env):
    os.symlink(env.outside, env.save / "step1" / "optim")
    os.symlink(env.outside / "a.bin", env.save / "step1" / "rank0.pt")
    assert env.store.delete_prefix(env.p("step1") + "/") == 3
    assert not (env.save / "step1").exists() and (env.save).is_dir()
    env.untouched()


# ------------------------------------------------------------ a link as an object
@pytest.fixture
def object_link(env):
    os.symlink(env.outside / "a.bin", env.save / "step1" / "x")
    return env


def test_reading_an_object_that_is_a_link_is_refused(object_link):
    env, url = object_link, object_link.p("step1", "x")
    reads = [
        lambda: env.store.get_bytes(url),
        lambda: env.store.get_bytes(url, start=1, end=3),
        lambda: env.store.open_range(url, 0, 4),
        lambda: env.store.stat(url),
        lambda: env.store.download_fileobj(url, io.BytesIO()),
        lambda: env.store.get_bytes_versioned(url),
        lambda: env.store.download_file(url, str(env.tmp / "copy")),
    ]
    for read in reads:
        with pytest.raises(UnsafeCheckpoint, match=r"step1/x is a symbolic link \(to .*a\.bin\)"):
            read()
    assert not (env.tmp / "copy").exists()
    env.untouched()


def test_delete_of_a_linked_object_removes_only_the_link(object_link):
    env = object_link
    env.store.delete(env.p("step1", "x"))
    assert not os.path.lexists(env.p("step1", "x"))
    env.untouched()


def test_writing_over_a_linked_object_never_writes_through_it(object_link):
    env, url = object_link, object_link.p("step1", "x")
    with pytest.raises(AlreadyExists):
        env.store.put_bytes(url, b"new", if_absent=True)
    with pytest.raises(AlreadyExists):
        env.store.upload_fileobj(io.BytesIO(b"new"), url, size=3, if_absent=True)
    assert os.path.islink(url)
    env.untouched()
    env.store.put_bytes(url, b"new")  # replace semantics: the link itself is replaced
    assert not os.path.islink(url) and env.store.get_bytes(url) == b"new"
    assert os.stat(url).st_mode & 0o777 == 0o600 & ~_umask()
    env.untouched()
    os.unlink(url)
    os.symlink(env.outside / "a.bin", url)
    env.store.upload_fileobj(io.BytesIO(b"newer"), url, size=5)
    assert env.store.get_bytes(url) == b"newer"
    assert [n for n in os.listdir(env.p("step1")) if n.startswith(".tmp-")] == []
    env.untouched()


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


# ------------------------------------------------------------ a link as a folder on the way
def test_a_linked_folder_on_the_way_is_refused_for_writes(env):
    os.symlink(env.outside, env.save / "step20")
    for write in (
        lambda u: env.store.put_bytes(u, b"w"),
        lambda u: env.store.put_bytes(u, b"w", if_absent=True),
        lambda u: env.store.upload_fileobj(io.BytesIO(b"w"), u, size=1),
    ):
        with pytest.raises(UnsafeCheckpoint, match="step20 is a symbolic link"):
            write(env.p("step20", "train", "rank0.pt"))
        with pytest.raises(UnsafeCheckpoint):
            write(env.p("step20", "a.bin"))
    env.untouched()  # no outside/train, a.bin kept
    with pytest.raises(UnsafeCheckpoint):
        env.store.delete(env.p("step20", "a.bin"))
    with pytest.raises(UnsafeCheckpoint):
        env.store.get_bytes(env.p("step20", "sub", "b.bin"))
    env.untouched()


def test_a_link_above_the_save_folder_is_refused_unless_resolved(env):
    os.symlink(env.save, env.tmp / "mine")  # the user's own link to the save folder
    via_link = str(env.tmp / "mine" / "step1" / "model.bin")
    with pytest.raises(UnsafeCheckpoint, match="mine is a symbolic link"):
        env.store.get_bytes(via_link)
    assert env.store.get_bytes(resolve_local(via_link)) == b"model"
    env.store.put_bytes(resolve_local(str(env.tmp / "mine" / "step2" / "m.bin")), b"2")
    assert (env.save / "step2" / "m.bin").read_bytes() == b"2"
    env.untouched()


# ------------------------------------------------------------ a link as the latest pointer
def test_a_linked_latest_pointer_is_neither_read_nor_replaced(env):
    latest = env.p("latest")
    os.symlink(env.outside / "latest", latest)
    with pytest.raises(UnsafeCheckpoint):
        env.store.get_bytes_versioned(latest)
    st = os.stat(env.outside / "latest")  # the version a reader following the link would see
    with pytest.raises(UnsafeCheckpoint):
        env.store.put_bytes_if_match(latest, b"step2", f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}")
    with pytest.raises((UnsafeCheckpoint, PreconditionFailed)):
        env.store.put_bytes_if_match(latest, b"step2", "0-0-0")
    assert os.path.islink(latest)
    env.untouched()


def test_a_linked_lock_file_is_refused(env):
    latest = env.p("latest")
    env.store.put_bytes(latest, b"step1")
    _, version = env.store.get_bytes_versioned(latest)
    os.symlink(env.outside / "a.bin", env.p(".tmp-cas-latest"))
    with pytest.raises(UnsafeCheckpoint, match="tmp-cas-latest is a symbolic link"):
        env.store.put_bytes_if_match(latest, b"step2", version)
    assert env.store.get_bytes(latest) == b"step1"
    env.untouched()
    os.unlink(env.p(".tmp-cas-latest"))
    env.store.put_bytes_if_match(latest, b"step2", version)  # the ordinary case still works
    assert env.store.get_bytes(latest) == b"step2"
    with pytest.raises(PreconditionFailed):
        env.store.put_bytes_if_match(latest, b"step3", version)


# ------------------------------------------------------------ other planted things
@pytest.mark.timeout(30)  # a regression would block in open()
def test_a_planted_fifo_is_not_an_object_and_does_not_hang(env):
    os.mkfifo(env.p("step1", "pipe"))
    with pytest.raises(NotFound):
        env.store.get_bytes(env.p("step1", "pipe"))
    with pytest.raises(NotFound):
        env.store.stat(env.p("step1", "pipe"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root searches any folder")
def test_a_search_only_folder_on_the_way_still_works(env):
    os.chmod(env.save, 0o711)
    try:
        env.store.put_bytes(env.p("step1", "y"), b"y")
        assert env.store.get_bytes(env.p("step1", "y")) == b"y"
    finally:
        os.chmod(env.save, 0o755)


# ------------------------------------------------------------ resolve_local / resolve_step_dir
def test_resolve_local_resolves_links_and_keeps_the_form(env):
    os.symlink(env.save, env.tmp / "mine")
    real = str(env.save)
    assert resolve_local(str(env.tmp / "mine")) == real
    assert resolve_local(str(env.tmp / "mine") + "/") == real + "/"
    assert resolve_local("file://" + str(env.tmp / "mine" / "step1")) == "file://" + real + "/step1"
    assert resolve_local(str(env.tmp / "mine" / "step9")) == real + "/step9"  # need not exist
    for url in ("s3://bucket/run/step1", "gs://bucket/run/"):
        assert resolve_local(url) == url and resolve_step_dir(url) == url


def test_resolve_step_dir_keeps_a_linked_step_folder_so_it_is_refused(env):
    os.symlink(env.save, env.tmp / "mine")
    os.symlink(env.outside, env.save / "step99")
    step = resolve_step_dir(str(env.tmp / "mine" / "step99") + "/")
    assert step == str(env.save / "step99") + "/"
    assert resolve_step_dir("file://" + str(env.tmp / "mine" / "step1")) == "file://" + str(env.save / "step1")
    assert resolve_local(str(env.tmp / "mine" / "step99")) == str(env.outside)  # what must not be used for a step
    with pytest.raises(UnsafeCheckpoint):
        env.store.put_bytes(step + "train/rank0.pt", b"w")
    with pytest.raises(UnsafeCheckpoint):
        env.store.delete_prefix(step)
    env.untouched()
