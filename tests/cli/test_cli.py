"""The ``cloudckpt`` CLI, driven as a subprocess against SeaweedFS (s3://),
fake-gcs-server (gs://) and local folders: output (tables and --json), exit codes,
one-line errors, and what each command changes (or, in a dry run, does not)."""

from __future__ import annotations

import json
import time

import pytest

from cloudckpt.checkpoint import retention
from cloudckpt.cli import parse_duration
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls
from cloudckpt.transfer import crc32c_bytes

from .helpers import BACKENDS, cli, new_root, save_steps, write_fake_steps, write_incomplete_step


def _contents(folder: str) -> dict[str, tuple[int, str]]:
    """Every object under ``folder``: relative path -> (size, CRC32C), read back whole."""
    store, prefix = open_store(folder), urls.as_prefix(folder)
    return {o.url[len(prefix):]: (len(b := store.get_bytes(o.url)), crc32c_bytes(b)) for o in store.walk(prefix)}


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory):
    """On each backend a run with steps 10 (persistent), 20 (ephemeral), 30 (persistent),
    all real checkpoints, and an uncommitted step40. Read-only: the tests that share it
    only read it (a command that changes a run gets its own, from ``fresh``), and at the
    end of the module every object in it is as it was."""
    out = {}
    for b in BACKENDS:
        folder = new_root(b, stores, tmp_path_factory) + "/run-1"
        save_steps(folder, [(10, False), (20, True), (30, False)], str(tmp_path_factory.mktemp("work")))
        write_incomplete_step(folder, 40)
        out[b] = folder
    before = {b: _contents(f) for b, f in out.items()}
    yield out
    after = {b: _contents(f) for b, f in out.items()}
    assert after == before, "a test changed the read-only runs"


@pytest.fixture
def fresh(stores, tmp_path_factory):
    """A factory of empty folders on a backend, for tests that change what they look at."""
    return lambda backend: new_root(backend, stores, tmp_path_factory) + "/run"


def _damage(folder_step: str) -> tuple[str, str]:
    """Flip one byte of the first DCP shard and delete the train state. Returns their paths."""
    store = open_store(folder_step)
    shard = "model_and_optim/__0_0.distcp"
    url = urls.join(folder_step, shard)
    data = bytearray(store.get_bytes(url))
    data[len(data) // 2] ^= 0x01
    store.put_bytes(url, bytes(data))
    store.delete(urls.join(folder_step, "train/rank0.pt"))
    return shard, "train/rank0.pt"


# ------------------------------------------------------------------ list / latest
@pytest.mark.parametrize("backend", BACKENDS)
def test_list_shows_committed_steps_flagged_and_all_adds_incomplete(runs, backend):
    folder = runs[backend]
    r = cli("list", folder)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].split() == ["STEP", "KIND", "FORMAT", "SIZE", "OBJECTS", "WORLD", "CREATED", "AGE", "URL"]
    rows = {int(ln.split()[0]): ln.split() for ln in lines[1:4]}
    assert {s: row[1] for s, row in rows.items()} == {10: "persistent", 20: "ephemeral", 30: "persistent"}
    assert all(row[2] == "cloudckpt" and row[4] == "6" and row[5] == "1" and row[-1] == f"{folder}/step{s}"
               for s, row in rows.items())
    assert "step40" not in r.out and lines[-1].startswith("3 committed (2 persistent, 1 ephemeral)")

    r = cli("list", folder, "--all", "--json")  # JSON Lines: one object per step
    assert r.code == 0, r.err
    steps = r.lines()
    by_step = {s["step"]: s for s in steps}
    assert [s["step"] for s in steps] == [10, 20, 30, 40] and {s["type"] for s in steps} == {"step"}
    assert [by_step[s]["status"] for s in (10, 20, 30, 40)] == ["committed"] * 3 + ["incomplete"]
    assert [by_step[s]["ephemeral"] for s in (10, 20, 30, 40)] == [False, True, False, None]
    for s in (10, 20, 30):
        assert by_step[s]["object_count"] == 6 and by_step[s]["world_size"] == 1 and by_step[s]["size_bytes"] > 0
        assert 0 <= by_step[s]["age_seconds"] < 3600 and by_step[s]["url"] == f"{folder}/step{s}"
    r = cli("list", folder, "--all", "--json-pretty")  # the same rows as one indented document
    doc = json.loads(r.out)
    assert doc["folder"] == folder and [s["step"] for s in doc["steps"]] == [10, 20, 30, 40]
    assert r.out.startswith("{\n")


def test_list_filters_ephemeral_and_persistent(runs):
    r = cli("--json", "list", runs["s3"], "--ephemeral")  # global options also before the command
    assert r.code == 0, r.err
    assert [s["step"] for s in r.lines()] == [20]
    r = cli("list", runs["s3"], "--persistent")
    assert r.code == 0, r.err
    assert [int(ln.split()[0]) for ln in r.out.splitlines()[1:-1]] == [10, 30]


def test_list_of_an_empty_folder_says_so_and_exits_3(fresh):
    folder = fresh("s3")
    r = cli("list", folder)
    assert r.code == 3 and r.out == "" and "no checkpoints in " + folder in r.assert_one_line_error()
    r = cli("list", folder, "--json")
    assert r.code == 3 and r.out == "" and "no checkpoints in " + folder in r.assert_one_line_error()


@pytest.mark.parametrize("backend", BACKENDS)
def test_latest_prints_the_newest_committed_step_url(runs, backend):
    r = cli("latest", runs[backend])
    assert r.code == 0, r.err
    assert r.out == f"{runs[backend]}/step30\n"  # step40 is not committed


def test_latest_lists_and_a_lagging_pointer_never_hides_the_newer_step(fresh):
    folder = fresh("s3")
    write_fake_steps(folder, {10: False, 30: False})
    open_store(folder).put_bytes(folder + "/latest", json.dumps({"step": 10}).encode())  # lags: step30 came later
    assert cli("latest", folder).out == folder + "/step30\n"
    assert cli("latest", folder, "--pointer").out == folder + "/step30\n"


def test_latest_json_and_exit_1_with_a_clear_message_when_none(runs, fresh):
    r = cli("latest", runs["gcs"], "--json")
    assert r.code == 0 and r.json() == {"folder": runs["gcs"], "step": 30, "url": runs["gcs"] + "/step30"}
    folder = fresh("s3")
    write_incomplete_step(folder, 5)
    r = cli("latest", folder)
    assert r.code == 1 and r.out == ""
    assert "no committed checkpoint in " + folder in r.assert_one_line_error()


# ------------------------------------------------------------------ inspect
@pytest.mark.parametrize("backend", ["s3", "gcs"])  # local: the table test below (each inspect imports torch)
def test_inspect_json_shows_tensors_train_state_keys_and_marker(runs, backend):
    step = runs[backend] + "/step20"
    r = cli("inspect", step, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["url"] == step
    m = doc["marker"]
    assert (m["step"], m["ephemeral"], m["world_size"], m["object_count"], m["format_version"]) == (20, True, 1, 6, 3)
    assert m["library_version"] and m["torch_version"] and m["save_id"] and m["created"]
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert tensors["model.w"] == {"key": "model.w", "dtype": "float32", "shape": [4], "numel": 4, "size_bytes": 16,
                                  "chunks": 1}
    assert tensors["model.b"]["dtype"] == "bfloat16" and tensors["model.b"]["shape"] == [2, 3]
    assert tensors["model.b"]["size_bytes"] == 12
    assert doc["non_tensor_keys"] == ["optim.lr"]
    ts = doc["train_state"]
    assert ts["path"] == "train/rank0.pt" and ts["type"] == "dict"
    assert {k["key"]: k["value"] for k in ts["keys"]} == {"step": 20, "tokens": 20000, "rng": None}
    assert sorted(o["path"] for o in doc["objects"]) == [  # the rank's manifest part is an object of the step
        "index/header.json", "manifest/rank0.json", "model_and_optim/.metadata", "model_and_optim/__0_0.distcp",
        "model_and_optim/__0_1.distcp", "train/rank0.pt"]


def test_inspect_table_is_readable(runs):
    r = cli("inspect", runs["local"] + "/step30", "--objects")
    assert r.code == 0, r.err
    out = r.out
    assert "step 30, persistent, world size 1, 6 objects" in out
    assert "model.w" in out and "float32" in out and "2x3" in out and "bfloat16" in out
    assert "non-tensor entries: optim.lr" in out
    assert "train state (train/rank0.pt): dict" in out and "tokens" in out and "30000" in out
    assert "model_and_optim/__0_0.distcp" in out  # --objects


# ------------------------------------------------------------------ verify
@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_passes_on_an_intact_checkpoint(runs, backend):
    r = cli("verify", runs[backend] + "/step10")
    assert r.code == 0, r.err
    assert r.out.startswith("OK: 6 objects") and r.err == ""


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_names_a_flipped_byte_and_a_missing_object(fresh, backend, tmp_path):
    folder = fresh(backend)
    save_steps(folder, [(7, False)], str(tmp_path / "w"))
    step = folder + "/step7"
    shard, train = _damage(step)

    r = cli("verify", step)
    assert r.code == 1, r.out + r.err
    assert f"BAD  {shard}: CRC32C" in r.out and f"BAD  {train}: object is missing" in r.out
    assert "FAILED: 2 of 6 objects" in r.out
    err = r.assert_one_line_error()
    assert shard in err and train in err

    r = cli("verify", step, "--json")
    assert r.code == 1
    doc = r.json()
    assert doc["ok"] is False and doc["object_count"] == 6
    assert {b["path"]: b["problem"] for b in doc["bad"]} == {shard: "crc32c", train: "missing"}

    # --size-only checks existence and size (HEAD) only: it sees the missing object, not the flipped byte
    r = cli("verify", step, "--size-only", "--json")
    assert r.code == 1 and {b["path"] for b in r.json()["bad"]} == {train}


# ------------------------------------------------------------------ download
def test_download_is_resumable_and_makes_a_loadable_local_checkpoint(fresh, tmp_path):
    import torch

    from cloudckpt import Checkpointer

    folder = fresh("s3")
    save_steps(folder, [(100, False)], str(tmp_path / "w"))
    src = folder + "/step100"
    dest_root = tmp_path / "local-run"

    r = cli("download", src, dest_root, "--progress")  # DEST not named step{N}: the step goes inside it
    assert r.code == 0, r.err
    dest = dest_root / "step100"
    assert "downloaded 6 object(s)" in r.out and "skipped 0" in r.out and str(dest) in r.out
    assert "download step100" in r.err and "100%" in r.err  # the tqdm bar
    assert (dest / ".metadata.json").read_bytes() == open_store(src).get_bytes(src + "/.metadata.json")

    r = cli("download", src, dest, "--json")  # again, DEST named step100: everything is skipped
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["downloaded"] == [] and len(doc["skipped"]) == 6 and doc["bytes_downloaded"] == 0
    assert doc["dest"] == str(dest)

    # a damaged and a missing local file are fetched again, nothing else
    shard = dest / "model_and_optim" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    (dest / "train" / "rank0.pt").unlink()
    r = cli("download", src, dest, "--json")
    assert r.code == 0, r.err
    assert sorted(r.json()["downloaded"]) == ["model_and_optim/__0_0.distcp", "train/rank0.pt"]

    # DEST is a committed local checkpoint: list and load it
    r = cli("list", dest_root, "--json")
    assert [(s["step"], s["status"]) for s in r.lines()] == [(100, "committed")]
    sd = {"model": {"w": torch.zeros(4), "b": torch.ones(2, 3, dtype=torch.bfloat16)}, "optim": {"lr": 0.0}}
    with Checkpointer(work_dir=str(tmp_path / "w2")) as ck:
        train = ck.load(str(dest), sd)
    assert train["step"] == 100 and torch.equal(sd["model"]["w"], torch.full((4,), 100.0)) and sd["optim"]["lr"] == 0.1


def test_download_from_gcs(fresh, tmp_path):
    folder = fresh("gcs")
    save_steps(folder, [(3, True)], str(tmp_path / "w"))
    r = cli("download", folder + "/step3", tmp_path / "d" / "step3", "--json", "--no-progress")
    assert r.code == 0, r.err
    assert len(r.json()["downloaded"]) == 6 and r.err == ""
    assert (tmp_path / "d" / "step3" / ".metadata.json").is_file()


def test_download_of_a_damaged_checkpoint_fails_and_leaves_dest_uncommitted(fresh, tmp_path):
    folder = fresh("s3")
    save_steps(folder, [(9, False)], str(tmp_path / "w"))
    _damage(folder + "/step9")
    dest = tmp_path / "d" / "step9"
    r = cli("download", folder + "/step9", dest)
    assert r.code == 1, r.out + r.err
    assert "train/rank0.pt" in r.assert_one_line_error() and "cloudckpt verify" in r.err
    assert not (dest / ".metadata.json").exists()


# ------------------------------------------------------------------ prune
PRUNE_STEPS = {100: False, 200: False, 250: True, 300: False, 350: True, 400: False, 450: True}


def _committed(folder: str) -> list[int]:
    from cloudckpt.checkpoint import discovery

    return [s for s, _ in discovery.find_checkpoints(folder)]


def test_prune_is_a_dry_run_by_default_and_deletes_marker_and_objects_with_yes(fresh):
    folder = fresh("s3")
    write_fake_steps(folder, PRUNE_STEPS, object_size=10)

    # keep-last 2 persistent (400, 300) + the newest ephemeral (450, also the newest step)
    r = cli("prune", folder, "--keep-last", "2", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["dry_run"] is True and doc["deleted"] == []
    assert [i["step"] for i in doc["prune"]] == [100, 200, 250, 350] and doc["kept"] == [300, 400, 450]
    assert _committed(folder) == sorted(PRUNE_STEPS)  # nothing deleted

    r = cli("prune", folder, "--keep-last", "1", "--keep-every", "200", "--json")
    assert [i["step"] for i in r.json()["prune"]] == [100, 250, 350]  # 200 and 400 kept and not counted: 300 is the 1

    r = cli("prune", folder, "--keep-last", "2", "--ephemeral-only", "--json")
    assert [i["step"] for i in r.json()["prune"]] == [250]  # persistent untouched, newest 2 ephemeral kept

    r = cli("prune", folder, "--keep-last", "2")
    assert r.code == 0 and "would delete 4 of 7 committed step(s)" in r.out and "--yes" in r.out

    r = cli("prune", folder, "--keep-last", "2", "--yes")
    assert r.code == 0, r.err
    assert r.out.count("deleted ") == 4
    assert _committed(folder) == [300, 400, 450]
    store = open_store(folder)
    for s in (100, 200, 250, 350):
        assert list(store.walk(urls.as_prefix(f"{folder}/step{s}"))) == []  # objects gone too, not only the marker


def test_list_all_skips_folders_emptied_by_prune_and_sizes_incomplete_ones(fresh):
    folder = fresh("s3")
    write_fake_steps(folder, PRUNE_STEPS, object_size=10)
    assert cli("prune", folder, "--keep-last", "2", "--yes").code == 0
    open_store(folder).put_bytes(f"{folder}/step500/model_and_optim/__0_0.distcp", b"x" * 7)
    rows = cli("list", folder, "--all", "--json").lines()
    # SeaweedFS keeps emptied folders as prefixes: they are not shown as steps
    assert [(r["step"], r["status"]) for r in rows] == [(300, "committed"), (400, "committed"), (450, "committed"),
                                                        (500, "incomplete")]
    assert rows[-1]["object_count"] == 1 and rows[-1]["size_bytes"] == 7 and rows[-1]["age_seconds"] is not None


@pytest.mark.parametrize("backend", ["gcs", "local"])
def test_prune_yes_on_other_backends(fresh, backend):
    folder = fresh(backend)
    write_fake_steps(folder, {1: True, 2: True, 3: False, 4: True}, object_size=3)
    r = cli("prune", folder, "--keep-last", "1", "--ephemeral-only", "--yes", "--json")
    assert r.code == 0, r.err
    assert r.json()["deleted"] == [1, 2]
    assert _committed(folder) == [3, 4]


# ------------------------------------------------------------------ gc
def _wait_until_gc_sees(folder: str, step_dirs: list[str], *, uploads: int = 0, timeout: float = 10.0) -> None:
    """Poll (a dry run, in process) until ``--older-than 0s`` would take what was just
    written: a store's object times may have one-second resolution, so a fresh object
    can look younger than "now" for up to a second."""
    deadline = time.monotonic() + timeout
    while True:
        rep = retention.gc(folder, older_than=0, dry_run=True)
        if rep.step_dirs == step_dirs and len(rep.uploads) == uploads:
            return
        assert time.monotonic() < deadline, f"gc --older-than 0s still sees {rep} after {timeout}s"
        time.sleep(0.05)


def test_gc_removes_old_uncommitted_folders_and_multipart_uploads_only_with_yes(fresh, stores):
    folder = fresh("s3")
    write_fake_steps(folder, {10: False}, object_size=5)
    write_incomplete_step(folder, 20)
    bucket, key = urls.parse_url(folder).bucket, urls.parse_url(folder).key
    client = stores["seaweed"].client()
    client.create_multipart_upload(Bucket=bucket, Key=f"{key}/step30/model_and_optim/__0_0.distcp")

    r = cli("gc", folder, "--json")  # default --older-than 1h: everything is younger
    assert r.code == 0, r.err
    assert r.json() == {"folder": folder, "dry_run": True, "older_than_seconds": 3600.0, "step_dirs": [], "uploads": [],
                        "failed": [], "young": [folder + "/step20"], "refusal_notes": []}  # kept, and said so

    _wait_until_gc_sees(folder, [folder + "/step20"], uploads=1)
    r = cli("gc", folder, "--older-than", "0s", "--json")
    doc = r.json()
    assert doc["dry_run"] is True and doc["step_dirs"] == [folder + "/step20"]
    assert doc["uploads"] == [f"{folder}/step30/model_and_optim/__0_0.distcp"]
    assert open_store(folder).exists(folder + "/step20/train/rank0.pt")  # dry run

    r = cli("gc", folder, "--older-than", "0s", "--yes")
    assert r.code == 0, r.err
    assert f"removed uncommitted step folder {folder}/step20" in r.out and "aborted multipart upload" in r.out
    store = open_store(folder)
    assert list(store.walk(urls.as_prefix(folder + "/step20"))) == []
    assert store.list_multipart_uploads(urls.as_prefix(folder)) == []
    assert _committed(folder) == [10] and store.exists(folder + "/step10/train/rank0.pt")


@pytest.mark.parametrize("backend", ["gcs", "local"])
def test_gc_yes_on_other_backends(fresh, backend):
    folder = fresh(backend)
    write_fake_steps(folder, {1: False}, object_size=3)
    write_incomplete_step(folder, 2)
    _wait_until_gc_sees(folder, [folder + "/step2"])
    r = cli("gc", folder, "--older-than", "0s", "--yes", "--json")
    assert r.code == 0, r.err
    assert r.json()["step_dirs"] == [folder + "/step2"]
    r = cli("list", folder, "--all", "--json")
    assert [(s["step"], s["status"]) for s in r.lines()] == [(1, "committed")]


def test_parse_duration_accepts_units_and_compounds():
    assert parse_duration("30m") == 1800 and parse_duration("2h") == 7200 and parse_duration("1d") == 86400
    assert parse_duration("1h30m") == 5400 and parse_duration("90") == 90 and parse_duration("0s") == 0
    for bad in ("", "h", "2x", "1.5.h", "-1h", "10 m"):
        with pytest.raises(ValueError):
            parse_duration(bad)


# ------------------------------------------------------------------ errors
ERROR_CASES = {
    # id: (args, exit code, words the one-line message must contain)
    "bad-bucket-name": (["list", "s3://Bad_Bucket/run"], 2, ["invalid bucket name"]),
    "unknown-scheme": (["list", "ftp://bucket/run"], 2, ["unknown storage scheme", "s3://"]),
    "s3-missing-bucket": (["list", "s3://no-such-bucket-cli/run"], 3, ["does not exist", "create it or fix the URL"]),
    "gcs-missing-bucket": (["inspect", "gs://no-such-bucket-cli/run/step1"], 3, ["does not exist"]),
    "not-a-checkpoint": (["inspect", "{run}"], 3,
                         ["is a save folder (a run), not a step", "the newest is {run}/step30"]),
    "incomplete-step": (["verify", "{run}/step40"], 3, ["is not a committed checkpoint", "the newest is {run}/step30"]),
    "download-to-a-url": (["download", "{run}/step10", "s3://x-bucket/y"], 2, ["not a local path"]),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_are_one_line_saying_what_to_do_with_an_exit_code(runs, case):
    args, code, words = ERROR_CASES[case]
    r = cli(*[a.format(run=runs["s3"]) for a in args])
    assert r.code == code, r.out + r.err
    line = r.assert_one_line_error()
    assert line.startswith("cloudckpt: error: ")
    for w in words:
        assert w.format(run=runs["s3"]) in line


def test_usage_errors_exit_2():
    folder = "s3://usage-errors-never-reach-a-store/run"  # had one reached it: exit 3, bucket not found
    for args in (["gc", folder, "--older-than", "2x"], ["prune", folder, "--keep-last", "0"],
                 ["prune", folder], ["frobnicate"]):
        r = cli(*args)
        assert r.code == 2 and "Traceback" not in r.err and "usage: cloudckpt" in r.err, args


def test_access_denied_exits_4_and_never_prints_credentials(runs, stores, fresh, tmp_path):
    sw = stores["seaweed"]
    wrong = {"AWS_ACCESS_KEY_ID": sw.access_key, "AWS_SECRET_ACCESS_KEY": "not-the-secret-" + sw.secret_key[:4]}
    r = cli("list", runs["s3"], env=wrong)
    assert r.code == 4, r.out + r.err
    assert "access denied" in r.assert_one_line_error()

    read_only = {"AWS_ACCESS_KEY_ID": sw.ro_access_key, "AWS_SECRET_ACCESS_KEY": sw.ro_secret_key}
    r = cli("list", runs["s3"], "--json", env=read_only)
    assert r.code == 0 and len(r.lines()) == 3  # reading is allowed
    folder = fresh("s3")  # a prune that is allowed would delete: its own run, not the read-only one
    save_steps(folder, [(10, False), (20, True), (30, False)], str(tmp_path / "w"))
    r = cli("prune", folder, "--keep-last", "1", "--ephemeral-only", "--yes", env=read_only)
    assert r.code == 0 and "nothing to prune" in r.out  # only one ephemeral step: nothing to delete
    r = cli("prune", folder, "--keep-last", "1", "--yes", "--debug", env=read_only)
    assert r.code == 4, r.out + r.err
    assert "Traceback" in r.err and "access denied" in r.err.splitlines()[-1]  # --debug adds the traceback
    for secret in (sw.secret_key, sw.ro_secret_key, sw.ro_access_key, sw.access_key):
        assert secret not in r.out + r.err
    assert _committed(folder) == [10, 20, 30]  # the denied delete removed nothing


def test_storage_flags_select_the_endpoint(runs, stores):
    """--endpoint-url / --region override the env (here the env points nowhere useful)."""
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "eu-west-3"}
    r = cli("latest", runs["s3"], "--endpoint-url", stores["seaweed"].endpoint_url, "--region", "us-east-1", env=env)
    assert r.code == 0, r.err
    assert r.out.strip() == runs["s3"] + "/step30"


def test_an_unreadable_marker_is_not_counted_and_is_reported(fresh):
    folder = fresh("gcs")
    write_fake_steps(folder, {1: False})
    open_store(folder).put_bytes(folder + "/step2/.metadata.json", b"{not json")
    r = cli("list", folder, "--json")
    assert r.code == 0 and [s["step"] for s in r.lines()] == [1]
    assert "step2" in r.assert_one_line_error() and "warning" in r.err
    r = cli("list", folder, "--all", "--json")
    row = r.lines()[1]
    assert row["status"] == "unreadable" and "not valid JSON" in row["error"]
    r = cli("verify", folder + "/step2")
    assert r.code == 1 and "not valid JSON" in r.assert_one_line_error()


def test_a_local_io_error_is_one_line_with_exit_5(runs, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    r = cli("download", runs["local"] + "/step10", blocker / "step10")
    assert r.code == 5, r.out + r.err
    assert "check the local path" in r.assert_one_line_error()


# ------------------------------------------------------------------ typed errors and exit 3
@pytest.mark.parametrize("backend", BACKENDS)
def test_latest_of_a_folder_without_any_step_exits_3_and_list_of_uncommitted_steps_exits_0(fresh, backend):
    folder = fresh(backend)
    r = cli("latest", folder)
    said = f"{folder} does not exist" if backend == "local" else "no checkpoints in " + folder  # a prefix just is empty
    assert r.code == 3 and r.out == "" and said in r.assert_one_line_error()
    write_incomplete_step(folder, 5)
    r = cli("list", folder)
    assert r.code == 0 and "no committed checkpoints in" in r.out  # there are steps: not "nothing at all"
    assert cli("latest", folder).code == 1


def test_list_of_a_step_folder_exits_3_and_names_its_save_folder(runs):
    r = cli("list", runs["local"] + "/step10/model_and_optim")
    assert r.code == 3
    r = cli("list", runs["s3"] + "/step10")
    assert r.code == 3 and "use its save folder " + runs["s3"] in r.assert_one_line_error()


def test_an_endpoint_url_without_a_scheme_is_a_usage_error_saying_what_to_write(runs):
    r = cli("list", runs["s3"], "--endpoint-url", "127.0.0.1:9000")
    assert r.code == 2, r.out + r.err
    line = r.assert_one_line_error()
    assert "--endpoint-url '127.0.0.1:9000' has no scheme" in line and "write http://127.0.0.1:9000" in line
    assert "endpoint_url" not in line and "unexpected" not in line  # the flag, not the Python parameter


def test_an_http_folder_says_to_write_s3_and_put_the_endpoint_into_endpoint_url():
    r = cli("list", "http://user:pw@127.0.0.1:9000/bucket/run")
    assert r.code == 2, r.out + r.err
    line = r.assert_one_line_error()
    assert "s3://bucket/run" in line and "endpoint_url" in line and "http://127.0.0.1:9000" in line
    assert "user:pw" not in line and "invalid bucket name" not in line


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf"])
def test_timeout_options_take_positive_seconds(runs, value):
    for opt in ("--timeout", "--connect-timeout"):
        r = cli("list", runs["local"], opt, value)
        assert r.code == 2 and "seconds > 0" in r.err, r.err
    assert cli("list", runs["local"], "--timeout", "5", "--connect-timeout", "2").code == 0


# ------------------------------------------------------------------ export
def test_export_writes_safetensors_in_the_bucket_cast_to_bf16_and_refuses_to_overwrite(runs, tmp_path):
    import torch
    from safetensors.torch import load_file

    folder = runs["s3"]
    step = f"{folder}/step30"
    dest = f"{folder}-export/model.safetensors"  # outside the shared run folder
    r = cli("export", step, dest, "--dtype", "bfloat16", "--json")
    assert r.code == 0, r.err
    assert r.json()["tensors"] == 2
    local = tmp_path / "m.safetensors"
    open_store(dest).download_file(dest, str(local))
    t = load_file(str(local))
    assert t["w"].dtype == torch.bfloat16 and torch.equal(t["w"], torch.full((4,), 30.0, dtype=torch.bfloat16))
    again = cli("export", step, dest)
    assert again.code != 0 and "exists" in again.err and "Traceback" not in again.err
    assert cli("export", step, dest, "--force").code == 0
