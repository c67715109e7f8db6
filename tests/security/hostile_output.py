"""Terminal injection and keys the stores choke on (issue 31, class 10).

Names come from checkpoints and listings: tensor names, train-state keys and values,
marker strings, run and step folder names, object keys. Each try puts ESC/CSI
sequences, C1 controls (``\\x9b`` is a one-byte CSI), BEL, NUL, a bidi override or a
carriage return into one of them (with cloudckpt's own writer where it takes the
name, else by rewriting the marker or planting objects) and runs ONE command through
:func:`tests.security.tries.cli`, which refuses (a finding) any raw control character
in what the command printed. The delete tries also check the store afterwards: every
object of the removed folder is gone (S3's DeleteObjects cannot carry a key with a
control character in its XML; such keys are deleted one by one).
"""

from __future__ import annotations

import json
import os

from .tries import Try, cli, outside_untouched

MOD = "tests.security.hostile_output"

NASTY = {
    "csi": "\x1b[2J\x1b[31m",
    "osc-title": "\x1b]0;pwned\x07",
    "c1-csi": "\x9b31m",
    "nul": "a\x00b",
    "cr": "ok\rFAKE",
    "bidi": "\u202egnp.exe",
    "del-bs": "x\x7f\x08y",
}
# names that must also be folder or object names: NUL cannot be (local files, S3 keys)
NAMEABLE = {k: v for k, v in NASTY.items() if k != "nul"}


class Breach(AssertionError):
    """A finding: a delete left objects it reported removed, or a JSON line is not ASCII."""


def _save(folder: str, step: int, work: str, *, tensor_key: str = "w", train: dict | None = None) -> str:
    import torch

    from cloudckpt import Checkpointer
    from cloudckpt.storage import url as urls

    state = {"model": {tensor_key: torch.ones(4), "b": torch.zeros(2)}}
    url = urls.join(folder, f"step{step}")
    with Checkpointer(work_dir=work) as ck:
        ck.save(url, state, train if train is not None else {"step": step})
    return url


def _json_ascii(text: str) -> str:
    for line in text.splitlines():
        if line.strip() and not line.isascii():
            raise Breach(f"a --json line is not ASCII: {line[:200]!r}")
    return text


# ----------------------------------------------------------------- names from a checkpoint
def tensor_name(tmp: str, root: str, *, nasty: str, json_out: bool = False) -> str:
    step = _save(root, 1, os.path.join(tmp, "work"), tensor_key="w" + NASTY[nasty])
    with outside_untouched(tmp):
        out = cli("inspect", step, *(["--json"] if json_out else []))
    return _json_ascii(out) if json_out else out


def train_key(tmp: str, root: str, *, nasty: str, json_out: bool = False) -> str:
    s = NASTY[nasty]
    step = _save(root, 1, os.path.join(tmp, "work"), train={"k" + s: 1, "v": "value" + s, s: [s]})
    with outside_untouched(tmp):
        out = cli("inspect", step, *(["--json"] if json_out else []))
    return _json_ascii(out) if json_out else out


def marker_string(tmp: str, root: str, *, nasty: str, field: str, entry: str = "cli_inspect") -> str:
    """A marker string field rewritten (the marker as raw JSON: it names no object, so
    the manifest still matches)."""
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    folder = urls.join(root, "run")
    step = _save(folder, 1, os.path.join(tmp, "work"))
    store = open_store(step)
    murl = urls.join(step, ".metadata.json")
    d = json.loads(store.get_bytes(murl))
    d[field] = ("v" if field != "created" else "2026-01-01T00:00:00Z") + NASTY[nasty]
    store.put_bytes(murl, json.dumps(d).encode())
    with outside_untouched(tmp):
        if entry == "cli_list":
            return cli("list", folder)
        return cli("inspect", step)


# ----------------------------------------------------------------- names from a listing
def run_name(tmp: str, root: str, *, nasty: str, json_out: bool = False, level: str = "runs") -> str:
    """A run folder named with control characters: ``list ROOT`` (the runs) or ``list RUN``
    (its steps, whose URLs hold the run's name)."""
    from cloudckpt.storage import url as urls

    run = urls.join(root, "exp" + NAMEABLE[nasty])
    _save(run, 1, os.path.join(tmp, "work"))
    with outside_untouched(tmp):
        out = cli("list", root if level == "runs" else run, *(["--json"] if json_out else []))
    return _json_ascii(out) if json_out else out


# ----------------------------------------------------------------- keys in deletes
def _plant(root: str, rels: list[str]) -> None:
    if root.startswith("s3://"):
        from cloudckpt.storage import open_store

        store = open_store(root)
        bucket, _, prefix = root[len("s3://"):].partition("/")
        for rel in rels:  # through boto3 itself: a key with a newline is not a URL cloudckpt takes
            store.client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=b"junk")
    else:
        for rel in rels:
            p = os.path.join(root, *rel.split("/"))
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(b"junk")


def _left(root: str, sub: str) -> list[str]:
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    return [o.url for o in open_store(root).walk(urls.join(root, sub) + "/")]


def _junk(nasty: str) -> list[str]:
    s = NAMEABLE[nasty]
    return [f"junk{s}", f"sub{s}/x", f"nl\n{s}"]


def rm_keys(tmp: str, root: str, *, nasty: str) -> str:
    """A committed step with objects whose keys hold control characters: ``rm --yes``
    removes every one, or says which it could not (typed), never reports a removal it
    did not do."""
    from cloudckpt.storage import url as urls

    _save(root, 1, os.path.join(tmp, "work"))
    _plant(root, [f"step1/{j}" for j in _junk(nasty)])
    with outside_untouched(tmp):
        out = cli("rm", urls.join(root, "step1"), "--yes")
    left = _left(root, "step1")
    if left:
        raise Breach(f"rm said {out.strip()[:200]!r} and left {left[:3]!r}")
    return out


def gc_keys(tmp: str, root: str, *, nasty: str) -> str:
    """An uncommitted step folder holding only keys with control characters: ``gc --yes``
    removes it (and says so) or says it could not."""
    _save(root, 1, os.path.join(tmp, "work"))
    _plant(root, [f"step2/{j}" for j in _junk(nasty)])
    with outside_untouched(tmp):
        out = cli("gc", root, "--older-than", "0", "--yes")
    left = _left(root, "step2")
    if left:
        raise Breach(f"gc said {out.strip()[:200]!r} and left {left[:3]!r}")
    if "removed uncommitted step folder" not in out:
        raise Breach(f"gc did not report the folder it removed: {out[:300]!r}")
    return out


def _tries() -> list[Try]:
    out: list[Try] = []
    for nasty in NASTY:
        for json_out in (False, True):
            j = "-json" if json_out else ""
            out.append(Try(10, f"tensor-name-{nasty}{j}", f"a tensor name with {nasty}", "cli_inspect",
                           f"{MOD}:tensor_name", {"nasty": nasty, "json_out": json_out}, expect="ok"))
            out.append(Try(10, f"train-key-{nasty}{j}", f"train-state keys and values with {nasty}", "cli_inspect",
                           f"{MOD}:train_key", {"nasty": nasty, "json_out": json_out}, expect="ok"))
    for nasty in ("csi", "c1-csi", "nul"):  # the same names read from a bucket
        out.append(Try(10, f"tensor-name-{nasty}-s3", f"a tensor name with {nasty}", "cli_inspect",
                       f"{MOD}:tensor_name", {"nasty": nasty}, expect="ok", backend="s3"))
        out.append(Try(10, f"train-key-{nasty}-s3", f"train-state keys and values with {nasty}", "cli_inspect",
                       f"{MOD}:train_key", {"nasty": nasty}, expect="ok", backend="s3"))
    out.append(Try(10, "marker-torch_version-csi-s3", "the marker's torch_version with csi", "cli_inspect",
                   f"{MOD}:marker_string", {"nasty": "csi", "field": "torch_version"}, expect="ok", backend="s3"))
    # (save_id is not among them: manifest parts name it, so another one is a refused step)
    for field in ("library_version", "torch_version", "created"):
        for nasty in ("csi", "c1-csi", "cr"):
            out.append(Try(10, f"marker-{field}-{nasty}", f"the marker's {field} with {nasty}", "cli_inspect",
                           f"{MOD}:marker_string", {"nasty": nasty, "field": field}, expect="ok"))
    out.append(Try(10, "marker-created-csi-list", "the marker's created with csi, listed", "cli_list",
                   f"{MOD}:marker_string", {"nasty": "csi", "field": "created", "entry": "cli_list"}, expect="ok"))
    for backend in ("local", "s3"):
        for nasty in ("csi", "osc-title", "c1-csi", "cr", "bidi"):
            for level in ("runs", "steps"):
                out.append(Try(10, f"run-name-{level}-{nasty}-{backend}", f"a run folder named with {nasty}",
                               "cli_list", f"{MOD}:run_name", {"nasty": nasty, "level": level}, expect="ok",
                               backend=backend))
            out.append(Try(10, f"run-name-json-{nasty}-{backend}", f"a run folder named with {nasty} (--json)",
                           "cli_list", f"{MOD}:run_name", {"nasty": nasty, "json_out": True}, expect="ok",
                           backend=backend))
        for nasty in ("csi", "c1-csi", "cr", "bidi", "del-bs"):
            out.append(Try(10, f"rm-keys-{nasty}-{backend}", f"objects keyed with {nasty} (and a newline) in a step",
                           "cli_rm", f"{MOD}:rm_keys", {"nasty": nasty}, expect="ok", backend=backend))
            out.append(Try(10, f"gc-keys-{nasty}-{backend}", f"an uncommitted folder of keys with {nasty}",
                           "cli_gc", f"{MOD}:gc_keys", {"nasty": nasty}, expect="ok", backend=backend))
    return out


TRIES: list[Try] = _tries()
