"""Classes 4, 5, 6, 7 and 9 of the issue, for the small JSON documents and the step names:

- 5 (and 4): a planted ``latest`` pointer (non-finite numbers, an integer of 5,000
  digits, deep nesting, a 512 MiB document, wrong types) never stops a save, a resume,
  ``list`` or ``latest``; the save replaces it, and no reader reads more than its ceiling;
- 4: a commit marker and a Hugging Face ``config.json`` nested deeply are refused with a
  typed error (never a RecursionError);
- 7: folders spelled like steps but not ``step{N}`` (``step04``, ``step004``, ``step٤``,
  ``Step4``...), even holding a full copy of a step, are not steps: retention (``prune``,
  a manager save with ``max_checkpoints``) never counts or deletes them and keeps what it
  should keep, ``list --all`` shows them as junk, ``latest`` never names them;
- 9: an out-of-range ``created_unix`` in one marker, or a wrong type in the exact-resume
  state, is a typed error naming the step, and the rest of the run still lists, inspects
  and removes;
- 6: an OLMo-core step holding ``train/rank999999999.pt``: ``adopt`` refuses it at once.

Each target builds its folder with cloudckpt's own writer (tries.honest_step), plants
the crafted object, and calls one entry point; assertions inside a target (what must
still be there, what a save must have written) fail as untyped findings.
"""

from __future__ import annotations

import contextlib
import json
import resource

from .tries import OK, REFUSED, Try, cli, honest_step, outside_untouched, run_entry, zero_state

MiB = 1 << 20
READ_HEADROOM = 200 * MiB  # what a try may add to its peak memory when the planted object is 512 MiB


# ----------------------------------------------------------------- helpers
def _store(url: str):
    from cloudckpt.storage import open_store

    return open_store(url)


def _join(*parts: str) -> str:
    from cloudckpt.storage import url as urls

    return urls.join(*parts)


def _copy_step(src: str, dst: str) -> None:
    """Every object of the step folder ``src`` copied under ``dst`` (the marker last)."""
    store = _store(src)
    prefix = src.rstrip("/") + "/"
    objs = sorted(store.walk(prefix), key=lambda o: o.url.endswith(".metadata.json"))
    for o in objs:
        store.put_bytes(_join(dst, o.url[len(prefix):]), store.get_bytes(o.url))


def _exists(url: str) -> bool:
    return _store(url).exists(url)


@contextlib.contextmanager
def _bounded_memory(limit: int = READ_HEADROOM):
    """Fails (untyped) when the peak resident memory grew by more than ``limit`` inside:
    a planted 512 MiB document read whole shows here even where it fits the sandbox."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    yield
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if grew > limit:
        raise AssertionError(f"peak memory grew by {grew >> 20} MiB (at most {limit >> 20} MiB): a planted "
                             "object was read past its ceiling")


def _manager(folder: str, tmp: str, **kw):
    from cloudckpt import CheckpointConfig

    return CheckpointConfig(save_folder=folder, work_dir=f"{tmp}/work", save_interval=1, **kw).build()


def _resumes(folder: str, tmp: str, step: int) -> None:
    """A manager's resume of ``folder`` loads step ``step`` (train state ``{"step": step}``)."""
    mgr = _manager(folder, tmp)
    try:
        got = mgr.resume(zero_state())
    finally:
        mgr.close()
    assert got == {"step": step}, f"resume gave {got}, not step {step}"


def _latest_is(folder: str, step: int, *flags: str) -> None:
    out = cli("latest", folder, *flags)  # stdout first, then what was logged on stderr
    assert out.splitlines()[0].endswith(f"/step{step}"), out


def _save_with_manager(folder: str, tmp: str, step: int, **kw) -> None:
    """One synchronous manager save of ``step``; close() waits for its retention."""
    from .tries import honest_state

    mgr = _manager(folder, tmp, **kw)
    try:
        mgr.save(step, honest_state(), {"step": step})
    finally:
        mgr.close()


# ----------------------------------------------------------------- class 5 (and 4): the latest pointer
def _deep(n: int) -> bytes:
    return b'{"step": 1, "x": ' + b"[" * n + b"]" * n + b"}"


POINTERS: dict[str, tuple[str, object]] = {
    "infinity": ("{\"step\": Infinity} (OverflowError in pointer.advance before)", b'{"step": Infinity}'),
    "neg-infinity": ("{\"step\": -Infinity, \"pending\": false}", b'{"step": -Infinity, "pending": false}'),
    "nan": ("{\"step\": NaN}", b'{"step": NaN}'),
    "huge-float": ("{\"step\": 1e400} (a float that overflows to infinity)", b'{"step": 1e400}'),
    "long-int": ("a step of 5,000 digits", b'{"step": ' + b"7" * 5000 + b"}"),
    "above-2-63": ("step 2**63 (one past the largest step)", b'{"step": 9223372036854775808}'),
    "string-step": ("{\"step\": \"9\"}", b'{"step": "9"}'),
    "bool-step": ("{\"step\": true}", b'{"step": true}'),
    "float-step": ("{\"step\": 9.5}", b'{"step": 9.5}'),
    "pending-string": ("\"pending\": \"no\"", b'{"step": 9, "pending": "no"}'),
    "array": ("a JSON array", b"[9, false]"),
    "deep": ("nested 20,000 deep inside the size ceiling (RecursionError before)", _deep(20_000)),
    "deep-unbalanced": ("1,000,000 open brackets", b"[" * 1_000_000),
    "huge": ("a 512 MiB pointer (sparse on local, read whole by every save before)", "huge"),
    "not-utf8": ("bytes that are not UTF-8", b'{"step": 1, "x": "\xff\xfe"}'),
}


def _plant_pointer(root: str, case: str) -> None:
    data = POINTERS[case][1]
    url = _join(root, "latest")
    if data == "huge":
        import os
        import tempfile

        with tempfile.NamedTemporaryFile(dir=root if "://" not in root else None, delete=False) as f:
            f.write(b'{"step": 1, "pad": "')
            f.truncate(512 * MiB)  # sparse: costs no disk, and no memory to upload (streamed)
        if "://" in root:
            _store(root).upload_file(f.name, url)
            os.unlink(f.name)
        else:
            os.replace(f.name, os.path.join(root, "latest"))
        return
    _store(root).put_bytes(url, data)


def pointer_attack(tmp: str, root: str, case: str, entry: str) -> None:
    from cloudckpt.checkpoint import discovery, pointer

    honest_step(root, 1)
    _plant_pointer(root, case)
    with outside_untouched(tmp), _bounded_memory():
        if entry == "manager_save":
            _save_with_manager(root, tmp, 2)
            assert discovery.latest_checkpoint(root).rstrip("/").endswith("/step2")
            got = pointer.read(root)
            assert got is None, f"the planted pointer was read as {got}"  # saves leave it alone; readers refuse it
            return
        if entry == "resume":
            return _resumes(root, tmp, 1)
        if entry == "cli_latest_pointer":
            return _latest_is(root, 1, "--pointer")
        run_entry(entry, step=_join(root, "step1"), folder=root, tmp=tmp)


# ----------------------------------------------------------------- class 4: deep JSON elsewhere
def deep_marker(tmp: str, root: str, depth: int, entry: str) -> None:
    """Steps 1 and 3 honest, step 2's marker nested ``depth`` deep: step 2 is refused
    (not listed, not loaded), the others still serve."""
    honest_step(root, 1)
    step2 = honest_step(root, 2)
    honest_step(root, 3)
    _store(root).put_bytes(_join(step2, ".metadata.json"), b'{"format": "cloudckpt", "x": ' + b"[" * depth
                           + b"]" * depth + b"}")
    with outside_untouched(tmp):
        if entry == "resume":
            return _resumes(root, tmp, 3)
        if entry == "cli_latest":
            return _latest_is(root, 3)
        run_entry(entry, step=step2, folder=root, tmp=tmp)


def _hf_step(root: str, tmp: str, config: str) -> str:
    from cloudckpt import Checkpointer
    from cloudckpt.integrations._hf import FORMAT, HF_KEY

    from .tries import honest_state

    step = _join(root, "step1")
    with Checkpointer(work_dir=f"{tmp}/work-save") as ck:
        ck.save(step, honest_state(), {HF_KEY: {"format": FORMAT, "config": config, "trainer_state": "{}",
                                                "process_index": 0, "world_size": 1}})
    return step


HF_CONFIGS = {
    "deep": ("config.json nested 100,000 deep (RecursionError before)",
             '{"model_type": "gpt2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "deep-dicts": ("config.json of dicts nested 5,000 deep", '{"model_type": "gpt2", "x": ' + '{"a": ' * 5000
                   + "1" + "}" * 5000 + "}"),
    "infinity": ("config.json with \"vocab_size\": Infinity", '{"model_type": "gpt2", "vocab_size": Infinity}'),
    "long-int": ("config.json with a 4,000-digit integer", '{"model_type": "gpt2", "n": ' + "9" * 4000 + "}"),
    # built by the try that plants it: 40 MiB held by the sandbox's zygote is 40 MiB more for each try's fork
    "huge": ("config.json of 40 MiB", lambda: '{"model_type": "gpt2", "pad": "' + "x" * (40 * MiB) + '"}'),
    "lone-surrogate": ("config.json text holding a lone surrogate (kept, written escaped)",
                       '{"model_type": "gpt2", "x": "\ud800"}'),
}


def hf_config(tmp: str, root: str, case: str, entry: str) -> None:
    text = HF_CONFIGS[case][1]
    step = _hf_step(root, tmp, text() if callable(text) else text)
    with outside_untouched(tmp):
        if entry == "hf_export":
            from cloudckpt.integrations.hf_export import export_hf

            export_hf(step, f"{tmp}/dest-hf")
        else:  # hf_resume: the Trainer callback writes the step's config.json for the Trainer
            from cloudckpt.integrations.hf import CloudCheckpointCallback

            cb = CloudCheckpointCallback(root, work_dir=f"{tmp}/work", local_dir=f"{tmp}/dest-hf")
            cb.prepare_resume()


# ----------------------------------------------------------------- class 7: step spellings
JUNK = {
    "leading-zeros": ("step04/ and step004/ holding copies of step 4 (step 4 counted three times before)",
                      ["step04", "step004"]),
    "many-zeros": ("step0004/, step00000000000000000004/ copies of step 4", ["step0004", "step00000000000000000004"]),
    "zero-step": ("step00/ and step000/ copies of step 4 beside them", ["step00", "step000"]),
    "unicode-digit": ("step\u0664/ (ARABIC-INDIC DIGIT FOUR) and step\uff14/ (FULLWIDTH 4) copies of step 4",
                      ["step\u0664", "step\uff14"]),
    "case-and-suffix": ("Step4/, STEP4/, step4.old/, step4-copy/ copies of step 4",
                        ["Step4", "STEP4", "step4.old", "step4-copy"]),
    "sign-and-space": ("step+4/, step 4/ copies of step 4", ["step+4", "step 4"]),
    "long-number": ("step99999999999999999999/ (20 digits) holding a copy of step 4", ["step99999999999999999999"]),
}


def _junk_run(root: str, case: str) -> tuple[list[str], list[str]]:
    """Honest steps 3 and 4, and the junk folders of ``case`` (full copies of step 4).
    Returns (the step URLs, the junk folder URLs)."""
    steps = [honest_step(root, 3), honest_step(root, 4)]
    junk = [_join(root, name) for name in JUNK[case][1]]
    for j in junk:
        _copy_step(steps[1], j)
    return steps, junk


def _intact(urls_: list[str]) -> None:
    for u in urls_:
        assert _exists(_join(u, ".metadata.json")), f"{u} was deleted"


def junk_steps(tmp: str, root: str, case: str, entry: str) -> None:
    from cloudckpt.checkpoint import discovery

    steps, junk = _junk_run(root, case)
    with outside_untouched(tmp):
        if entry == "cli_prune":
            cli("prune", root, "--keep-last", "2", "--yes")  # steps 3 and 4 are the last two
            _intact(steps + junk)
        elif entry == "manager_save":
            _save_with_manager(root, tmp, 5, max_checkpoints=2)  # keeps 4 and 5, deletes 3
            _intact([steps[1], _join(root, "step5")] + junk)
            assert not _exists(_join(steps[0], ".metadata.json")), "step 3 was kept: retention counted junk"
        elif entry == "cli_gc":
            cli("gc", root, "--older-than", "0", "--yes")
            _intact(steps + junk)
        elif entry == "cli_list":
            rows = [json.loads(ln) for ln in cli("list", root, "--all", "--json").splitlines() if ln.startswith("{")]
            committed = sorted(r["step"] for r in rows if r.get("status") == "committed")
            assert committed == [3, 4], rows
            shown = sorted(r["url"].rstrip("/").rsplit("/", 1)[-1] for r in rows if r.get("status") == "junk")
            assert shown == sorted(JUNK[case][1]), (shown, rows)
            assert all(r["step"] is None for r in rows if r.get("status") == "junk"), rows
        elif entry == "cli_latest":
            _latest_is(root, 4)
        elif entry == "discovery":
            found = [s for s, _ in discovery.find_checkpoints(root)]
            assert found == [3, 4], found
        elif entry == "cli_rm":
            cli("rm", junk[0], "--yes")  # not a step: refused (rm removes one step)
        else:
            raise AssertionError(f"no entry {entry}")


# ----------------------------------------------------------------- class 9: marker times, exact-resume state
TIMES = {
    "infinity": ("\"created_unix\": Infinity (OverflowError in list/inspect/rm before)", b"Infinity"),
    "neg-infinity": ("\"created_unix\": -Infinity", b"-Infinity"),
    "nan": ("\"created_unix\": NaN", b"NaN"),
    "1e308": ("\"created_unix\": 1e308 (finite, past year 9999)", b"1e308"),
    "year-10000": ("\"created_unix\": 253402300800 (year 10000)", b"253402300800"),
    "negative": ("\"created_unix\": -1e18", b"-1e18"),
    "string-nan": ("\"created_unix\": \"nan\" (float() of a string)", b'"nan"'),
    "bool": ("\"created_unix\": true", b"true"),
    "long-int": ("\"created_unix\" of 3,000 digits", b"1" * 3000),
}


def marker_time(tmp: str, root: str, case: str, entry: str) -> None:
    """Steps 1 and 3 honest, step 2's marker with a bad ``created_unix``: the run still
    lists and resumes; step 2 is refused by inspect and removable by rm."""
    honest_step(root, 1)
    step2 = honest_step(root, 2)
    honest_step(root, 3)
    store = _store(step2)
    url = _join(step2, ".metadata.json")
    d = json.loads(store.get_bytes(url))
    d["created_unix"] = "@@T@@"
    store.put_bytes(url, json.dumps(d).replace('"@@T@@"', TIMES[case][1].decode()).encode())
    with outside_untouched(tmp):
        if entry == "cli_list":
            rows = [json.loads(ln) for ln in cli("list", root, "--json").splitlines() if ln.startswith("{")]
            assert sorted(r["step"] for r in rows) == [1, 3], rows
            return
        if entry == "cli_list_all":
            rows = [json.loads(ln) for ln in cli("list", root, "--all", "--json").splitlines() if ln.startswith("{")]
            assert {r["step"]: r["status"] for r in rows} == {1: "committed", 2: "unreadable", 3: "committed"}, rows
            return
        if entry == "cli_inspect_other":
            cli("inspect", _join(root, "step3"))
            return
        if entry == "cli_rm":
            cli("rm", step2, "--yes")
            assert not _exists(url)
            return
        run_entry(entry, step=step2, folder=root, tmp=tmp)


def _bad_resume_state(case: str):
    import torch

    from cloudckpt import exact_resume

    good = exact_resume.capture({})
    bad = {
        "state-int": lambda s: 7,
        "rng-list": lambda s: {**s, "rng": [1, 2]},
        "python-string": lambda s: {**s, "rng": {**s["rng"], "python": "getstate"}},
        "python-short": lambda s: {**s, "rng": {**s["rng"], "python": [3, [1, 2, 3], None]}},
        "python-word-too-big": lambda s: {**s, "rng": {**s["rng"], "python": [3, [1 << 40] * 625, None]}},
        "torch-int": lambda s: {**s, "rng": {**s["rng"], "torch": 5}},
        "torch-wrong-length": lambda s: {**s, "rng": {**s["rng"], "torch": torch.zeros(3, dtype=torch.uint8)}},
        "torch-float": lambda s: {**s, "rng": {**s["rng"], "torch": torch.zeros(5056)}},
        "numpy-keys-list": lambda s: {**s, "rng": {**s["rng"], "numpy": {**s["rng"]["numpy"], "keys": [1, 2]}}},
        "numpy-kind": lambda s: {**s, "rng": {**s["rng"], "numpy": {**s["rng"]["numpy"], "kind": "PCG64"}}},
        "loaders-string": lambda s: {**s, "loaders": "train"},
    }[case]
    return bad(good)


RESUME_STATES = ["state-int", "rng-list", "python-string", "python-short", "python-word-too-big", "torch-int",
                 "torch-wrong-length", "torch-float", "numpy-keys-list", "numpy-kind", "loaders-string"]


def exact_resume_state(tmp: str, root: str, case: str) -> None:
    from cloudckpt import Checkpointer, exact_resume

    from .tries import honest_state

    with Checkpointer(work_dir=f"{tmp}/work-save") as ck:
        ck.save(_join(root, "step1"), honest_state(), {"step": 1, exact_resume.KEY: _bad_resume_state(case)})
    with outside_untouched(tmp):
        mgr = _manager(root, tmp)
        try:
            mgr.resume(zero_state())
        finally:
            mgr.close()


# ----------------------------------------------------------------- class 6: adopt and a huge rank
RANKS = {
    "rank999999999": ("an OLMo-core step holding train/rank999999999.pt (10^9 names built before)",
                      ["train/rank999999999.pt"]),
    "rank99999999-and-0": ("train/rank0.pt and train/rank99999999.pt", ["train/rank99999999.pt"]),
    "many-high-ranks": ("train/rank{999999000..999999099}.pt", [f"train/rank{999999000 + i}.pt" for i in range(100)]),
    "leading-zero-rank": ("train/rank000000001.pt (not a rank file: one spelling)", ["train/rank000000001.pt"]),
}


def adopt_rank(tmp: str, root: str, case: str, entry: str) -> None:
    step = honest_step(root, 1)
    store = _store(step)
    store.put_bytes(_join(step, ".metadata.json"), b'{"ephemeral": false, "version": "3.0.0"}')
    for rel in RANKS[case][1]:
        store.put_bytes(_join(step, rel), b"not a train state")
    with outside_untouched(tmp), _bounded_memory():
        if entry == "cli_adopt":
            cli("adopt", step, "--yes")
        else:
            run_entry(entry, step=step, folder=root, tmp=tmp)


# ----------------------------------------------------------------- the tries
T = "tests.security.hostile_json"
TRIES: list[Try] = []

# On S3 too: every case through a save (which must leave it unread and in place), and five
# cases through every reader. The 512 MiB pointer is uploaded whole for each S3 try (5-8 s),
# so on S3 it goes through the save and resume only: list and latest read no pointer beside a
# step of ours, and meet a planted one on S3 through the four other cases.
_S3_POINTERS = ("infinity", "deep", "huge", "long-int", "string-step")
for _case, (_what, _) in POINTERS.items():
    for _entry in ("manager_save", "resume", "cli_list", "cli_latest", "cli_latest_pointer"):
        for _backend in ("local", "s3") if (_case in _S3_POINTERS and not (_case == "huge" and _entry.startswith(
                "cli_"))) or _entry == "manager_save" else ("local",):
            TRIES.append(Try(klass=4 if _case.startswith("deep") else 5, case=f"latest-{_case}", what=_what,
                             entry=_entry, target=f"{T}:pointer_attack", kwargs={"case": _case, "entry": _entry},
                             expect=OK, backend=_backend, timeout=60.0))

for _depth, _name in ((1_000_000, "marker-deep"), (10_000, "marker-deep-10k")):
    for _entry, _expect in (("cli_list", REFUSED), ("cli_inspect", REFUSED), ("load", REFUSED), ("resume", OK),
                            ("cli_latest", OK), ("cli_rm", OK)):
        for _backend in ("local", "s3") if _name == "marker-deep" else ("local",):
            TRIES.append(Try(klass=4, case=_name, what=f"a commit marker nested {_depth:,} deep", entry=_entry,
                             target=f"{T}:deep_marker", kwargs={"depth": _depth, "entry": _entry}, expect=_expect,
                             backend=_backend, timeout=60.0))

for _case, (_what, _) in HF_CONFIGS.items():
    for _entry in ("hf_export", "hf_resume"):
        TRIES.append(Try(klass=4, case=f"hf-config-{_case}", what=_what, entry=_entry, target=f"{T}:hf_config",
                         kwargs={"case": _case, "entry": _entry}, expect=OK if _case == "lone-surrogate" else REFUSED,
                         backend="s3" if _case == "deep" and _entry == "hf_export" else "local", timeout=60.0))

for _case, (_what, _) in JUNK.items():
    for _entry in ("cli_prune", "manager_save", "cli_list", "cli_latest", "discovery", "cli_gc", "cli_rm"):
        for _backend in ("local", "s3") if _case in ("leading-zeros", "unicode-digit") else ("local",):
            TRIES.append(Try(klass=7, case=f"junk-{_case}", what=_what, entry=_entry, target=f"{T}:junk_steps",
                             kwargs={"case": _case, "entry": _entry}, expect=REFUSED if _entry == "cli_rm" else OK,
                             backend=_backend, timeout=60.0))

for _case, (_what, _) in TIMES.items():
    for _entry, _expect in (("cli_list", OK), ("cli_list_all", OK), ("cli_inspect", REFUSED),
                            ("cli_inspect_other", OK), ("cli_rm", OK), ("cli_latest", OK), ("load", REFUSED)):
        for _backend in ("local", "s3") if _case in ("infinity", "1e308") else ("local",):
            TRIES.append(Try(klass=9, case=f"created-unix-{_case}", what=_what, entry=_entry,
                             target=f"{T}:marker_time", kwargs={"case": _case, "entry": _entry}, expect=_expect,
                             backend=_backend, timeout=60.0))

for _case in RESUME_STATES:
    for _backend in ("local", "s3") if _case in ("python-string", "torch-int") else ("local",):
        TRIES.append(Try(klass=9, case=f"exact-resume-{_case}", what=f"the exact-resume state: {_case}",
                         entry="resume", target=f"{T}:exact_resume_state", kwargs={"case": _case}, expect=REFUSED,
                         backend=_backend, timeout=60.0))

for _case, (_what, _) in RANKS.items():
    for _entry, _expect in (("cli_adopt", OK if _case == "leading-zero-rank" else REFUSED), ("cli_list", OK),
                            ("cli_inspect", OK)):
        for _backend in ("local", "s3") if _case == "rank999999999" else ("local",):
            TRIES.append(Try(klass=6, case=f"adopt-{_case}", what=_what, entry=_entry, target=f"{T}:adopt_rank",
                             kwargs={"case": _case, "entry": _entry}, expect=_expect, backend=_backend, timeout=60.0))
