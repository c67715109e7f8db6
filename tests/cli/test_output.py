"""Names from checkpoints and listings reach the terminal escaped (issue 31, class 10):
tensor names, train-state keys and values, run folders and object keys chosen by
whoever wrote the bucket never send a control character; JSON output is ASCII and
gives the exact names back; deletes of keys with control characters delete them and
count them."""

from __future__ import annotations

import io
import json
import re

import pytest

from cloudckpt.cli.output import EscapingStream, shown
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls

from .helpers import cli

RAW = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
TENSOR = "w\x1b[2J\x00"
KEY, VALUE = "k\x9b1m", "v\x1b]0;title\x07"
RUN = "exp\x1b[31m\u202e"


def test_shown_escapes_what_is_not_printable_and_keeps_the_rest():
    assert shown("model.w") == "model.w"
    assert shown("模型.权重 é") == "模型.权重 é"  # printable non-ASCII stays readable
    assert shown("a\x1b[31mb\x9bc\x00d\x7fe\u202ef\rg\th\ni") == \
        "a\\x1b[31mb\\x9bc\\x00d\\x7fe\\u202ef\\x0dg\\x09h\\x0ai"
    assert shown("t\tx\ny", keep="\t\n") == "t\tx\ny"
    assert shown("\udcff") == "\\udcff"  # a lone surrogate (an undecodable local file name)
    buf = io.StringIO()
    s = EscapingStream(buf)
    print("line one\x1b[2J\nline\ttwo\x85", file=s)
    assert buf.getvalue() == "line one\\x1b[2J\nline\ttwo\\x85\n"


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    import torch

    from cloudckpt import Checkpointer

    root = tmp_path_factory.mktemp("out") / "root"
    run = str(root / RUN)
    with Checkpointer(work_dir=str(tmp_path_factory.mktemp("work"))) as ck:
        ck.save(urls.join(run, "step1"), {"model": {TENSOR: torch.ones(4)}}, {KEY: VALUE, "n": 10 ** 600})
    return str(root), run


def _clean(r) -> str:
    assert r.code == 0, r.out + r.err
    text = r.out + r.err
    assert not RAW.search(text), repr(text[:500])
    return text


def test_inspect_shows_tensor_names_keys_and_values_escaped(hostile_run):
    _, run = hostile_run
    out = _clean(cli("inspect", urls.join(run, "step1")))
    assert "model.w\\x1b[2J\\x00" in out and "k\\x9b1m" in out and "'v\\x1b]0;title\\x07'" in out
    assert "exp\\x1b[31m\\u202e" in out  # the step's own URL holds the run's name
    assert "1994-bit integer" in out and "0" * 100 not in out  # a 600-digit value is named by its size
    doc = cli("inspect", urls.join(run, "step1"), "--json").json()
    assert [t["key"] for t in doc["tensors"]] == ["model." + TENSOR]
    assert {k["key"]: k["value"] for k in doc["train_state"]["keys"]}[KEY] == VALUE
    assert cli("inspect", urls.join(run, "step1"), "--json").out.isascii()


def test_list_shows_run_and_step_names_escaped(hostile_run):
    root, run = hostile_run
    out = _clean(cli("list", root))
    assert "exp\\x1b[31m\\u202e" in out
    out = _clean(cli("list", run))
    assert "exp\\x1b[31m\\u202e/step1" in out
    r = cli("list", root, "--json")
    assert r.out.isascii() and [x["url"] for x in r.lines()] == [run]


NASTY_KEYS = ["junk\x1b[2J", "sub\x9b31m/x", "nl\nx", "cr\rx", "bidi\u202ex"]


def test_rm_and_gc_delete_keys_with_control_characters_on_s3(s3_bucket, tmp_path):
    from .helpers import save_steps

    folder = f"{s3_bucket}/run"
    save_steps(folder, [(1, False), (2, False)], str(tmp_path / "w"))
    store = open_store(folder)
    bucket = s3_bucket[len("s3://"):]
    for k in NASTY_KEYS:  # planted through boto3 (a key with a newline is no URL cloudckpt takes as input)
        store.client.put_object(Bucket=bucket, Key=f"run/step1/{k}", Body=b"junk")
        store.client.put_object(Bucket=bucket, Key=f"run/step3/{k}", Body=b"junk")  # an uncommitted folder
    n1 = len(list(store.walk(folder + "/step1/")))
    r = cli("rm", folder + "/step1", "--yes")
    _clean(r)
    assert f"then {n1 - 1} object(s)" in r.out  # every object but the marker, counted as deleted
    assert list(store.walk(folder + "/step1/")) == []
    r = cli("gc", folder, "--older-than", "0s", "--yes")
    _clean(r)
    assert f"removed uncommitted step folder {folder}/step3" in r.out
    assert list(store.walk(folder + "/step3/")) == []
    assert store.exists(folder + "/step2/.metadata.json")


def test_json_output_is_ascii_and_loads_back_the_exact_names():
    # what every --json command prints: json.dumps with ensure_ascii (C0, C1 and all non-ASCII escaped)
    from cloudckpt.cli import output

    buf = io.StringIO()
    real = output.sys.stdout
    output.sys.stdout = buf
    try:
        output.emit(type("A", (), {"json_pretty": False})(), {"k": KEY + "\u202e\x85"})
        output.emit_records(type("A", (), {"json_pretty": True})(), [], {"k": VALUE})
    finally:
        output.sys.stdout = real
    text = buf.getvalue()
    assert text.isascii()
    first, rest = text.split("\n", 1)
    assert json.loads(first) == {"k": KEY + "\u202e\x85"} and json.loads(rest) == {"k": VALUE}
