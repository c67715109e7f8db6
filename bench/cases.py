"""The cases of the peer benchmark (``python -m bench.run``): what each one runs, in
which order, and what it records into ``Results``.

- ``case_save_load``: save, then load (streaming; pre-download and 2 -> 1 for
  cloudckpt), every tool in a rotated order each repetition, s5cmd's upload and
  download of the same bytes; each cloudckpt load followed at once by s5cmd's
  download of the same bytes (its paired reference, ``report.analyse``).
- ``case_gcs``: cloudckpt on fake-gcs-server against google-cloud-storage's
  ``transfer_manager`` copying the same files.
- ``case_discovery``: ``latest_checkpoint`` and ``cloudckpt list`` over N committed
  steps, HTTP requests counted; OLMo-core's ``latest_checkpoint`` beside them.

Each case asserts only that what was loaded matches what was saved; a failure is
the row's error, not the run's.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import BUCKET, ROOT, same, short_error, size_label
from bench.drivers import LocalCopies, Runner
from bench.measure import (
    Results,
    cpu_delta,
    delete_prefix,
    dir_bytes,
    run_s5cmd,
    s5cmd_binary,
    s5cmd_download,
    server_cpu,
    settle,
    summarize,
    warm_up,
)


def case_save_load(args, runner: Runner, res: Results, s3, nbytes: int, tools: list[str], log,
                   copies: LocalCopies) -> None:
    label = size_label(nbytes)
    # the bytes s5cmd copies: the same state, stock DCP FileSystemWriter, on local disk
    src_fp = src = None
    if "s5cmd" in tools:
        if s5cmd_binary() is None:
            res.fail("save", label, "s5cmd", "not installed", "no s5cmd binary in the venv or on PATH")
            res.fail("load", label, "s5cmd", "not installed", "no s5cmd binary in the venv or on PATH")
        else:
            src, src_fp = copies.get(nbytes)
    # every cloudckpt load is followed at once by s5cmd's download of the same bytes (a
    # copy uploaded here, untimed): its paired reference (see analyse)
    paired = f"s5cmd/{label}/paired/" if src_fp is not None and "cloudckpt" in tools else None
    if paired:
        run_s5cmd(args, runner.env, [f"{src}/*", f"s3://{BUCKET}/{paired}"])
    try:
        _save_load_reps(args, runner, res, s3, nbytes, tools, log, src, src_fp, paired)
    finally:
        if paired:
            delete_prefix(s3, paired)


def _save_load_reps(args, runner: Runner, res: Results, s3, nbytes: int, tools: list[str], log, src, src_fp,
                    paired: str | None) -> None:
    label = size_label(nbytes)
    R = args.ranks
    nb = dir_bytes(src) if src is not None else None  # the local copy's file bytes, what s5cmd moves
    for rep in range(args.reps):
        order = tools[rep % len(tools):] + tools[:rep % len(tools)]
        for tool in order:
            if tool == "s5cmd":
                if src_fp is None:
                    continue
                prefix = f"s5cmd/{label}/rep{rep}/"
                c0 = server_cpu(s3)
                up, up_cpu = run_s5cmd(args, runner.env, [f"{src}/*", f"s3://{BUCKET}/{prefix}"])
                res.add("save", label, "s5cmd", {"seconds": up, "bytes": src_fp["bytes"], "file_bytes": nb,
                                                  "client_cpu_s": up_cpu,
                                                  "server_cpu_s": cpu_delta(c0, server_cpu(s3))})
                c0 = server_cpu(s3)
                down, down_cpu = s5cmd_download(args, runner.env, prefix, nb)
                c1 = server_cpu(s3)
                res.add("load", label, "s5cmd", {"seconds": down, "bytes": src_fp["bytes"], "file_bytes": nb,
                                                  "client_cpu_s": down_cpu, "server_cpu_s": cpu_delta(c0, c1)})
                log(f"  rep {rep} s5cmd       up {up:6.2f}s  down {down:6.2f}s")
                delete_prefix(s3, prefix)
                continue
            if tool != "cloudckpt":
                py, why = runner.peer_python(tool)
                if py is None:
                    for case in ("save", "load"):
                        res.fail(case, label, tool, "not installed", why)
                    continue
            url = f"s3://{BUCKET}/{tool}/{label}/rep{rep}"
            try:
                c0 = server_cpu(s3)
                saved = summarize(runner.ranks(tool, "save", url, nbytes, R), "save")
                saved["server_cpu_s"] = cpu_delta(c0, server_cpu(s3))
            except Exception as e:  # noqa: BLE001 - reported as the row's error
                res.fail("save", label, tool, "error", short_error(str(e)))
                res.fail("load", label, tool, "error", "save failed")
                log(f"  rep {rep} {tool:11s} save FAILED: {short_error(str(e))}")
                continue
            res.add("save", label, tool, saved)
            line = f"  rep {rep} {tool:11s} save {saved['seconds']:6.2f}s"
            loads = [("load", R, {})]
            if tool == "cloudckpt":
                # --smoke skips pre-download (the same rank code with one flag) to stay short
                loads += ([] if args.smoke else [("load_pre", R, {"pre_download": True})]) + [("load_2to1", 1, {})]
            for case, ranks, extra in loads:
                try:
                    c0 = server_cpu(s3)
                    got = summarize(runner.ranks(tool, "load", url, nbytes, ranks, saved_ranks=R, **extra), "load")
                    got["server_cpu_s"] = cpu_delta(c0, server_cpu(s3))
                    if not same(got["fingerprint"], saved["fingerprint"]):
                        raise RuntimeError(f"loaded state differs from the saved one (fingerprint {got['fingerprint']} "
                                           f"!= {saved['fingerprint']})")
                except Exception as e:  # noqa: BLE001 - reported as the row's error
                    res.fail(case, label, tool, "error", short_error(str(e)))
                    line += f"  {case} FAILED: {short_error(str(e))}"
                    continue
                line += f"  {case} {got['seconds']:6.2f}s (rss x{got['rss_ratio']:.2f})"
                if paired and tool == "cloudckpt":
                    try:
                        got["s5cmd_paired_seconds"] = s5cmd_download(args, runner.env, paired, nb)[0]
                        line += f" s5cmd {got['s5cmd_paired_seconds']:5.2f}s"
                    except Exception as e:  # noqa: BLE001 - the pair is missing, the load's own figures stand
                        line += f" (paired s5cmd download FAILED: {short_error(str(e))})"
                res.add(case, label, tool, got)
            log(line)
            if not args.keep:
                delete_prefix(s3, f"{tool}/{label}/rep{rep}/")


def _timed(server, fn):
    """``fn()`` run in this process after a flush: (its result, wall seconds, client and
    server CPU seconds)."""
    from bench.ranks import self_cpu  # torch, like every case (the library modules import only the stdlib)

    settle()
    s0, c0, t0 = server_cpu(server), self_cpu(), time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return out, dt, {"client_cpu_s": self_cpu() - c0, "server_cpu_s": cpu_delta(s0, server_cpu(server))}


def case_gcs(args, runner: Runner, res: Results, gcs, nbytes: int, log, copies: LocalCopies) -> None:
    label = size_label(nbytes)
    R = args.ranks
    client = gcs.client()
    src, src_fp = copies.get(nbytes)
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    for rep in range(args.reps):
        for tool in (["cloudckpt", "gcs_tm"] if rep % 2 == 0 else ["gcs_tm", "cloudckpt"]):
            if tool == "gcs_tm":
                from google.cloud.storage import transfer_manager as tm

                bucket = client.bucket(BUCKET)
                prefix = f"tm/{label}/rep{rep}/"
                out, up, up_cpu = _timed(gcs, functools.partial(
                    tm.upload_many_from_filenames, bucket, files, source_directory=str(src), blob_name_prefix=prefix,
                    max_workers=args.gcs_workers, worker_type=tm.THREAD))
                bad = [r for r in out if isinstance(r, Exception)]
                if bad:
                    res.fail("gcs_save", label, tool, "error", short_error(repr(bad[0])))
                    continue
                dst = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-gdl-", dir=args.tmp))
                try:
                    out, down, down_cpu = _timed(gcs, functools.partial(
                        tm.download_many_to_path, bucket, files, destination_directory=str(dst),
                        blob_name_prefix=prefix, max_workers=args.gcs_workers, worker_type=tm.THREAD))
                finally:
                    shutil.rmtree(dst, ignore_errors=True)
                res.add("gcs_save", label, tool, {"seconds": up, "bytes": src_fp["bytes"], **up_cpu})
                res.add("gcs_load", label, tool, {"seconds": down, "bytes": src_fp["bytes"], **down_cpu})
                log(f"  rep {rep} gcs transfer_manager up {up:6.2f}s  down {down:6.2f}s")
                continue
            url = f"gs://{BUCKET}/cloudckpt/{label}/rep{rep}"
            stage = "gcs_save"
            try:
                s0 = server_cpu(gcs)
                saved = summarize(runner.ranks("cloudckpt", "save", url, nbytes, R), "save")
                saved["server_cpu_s"] = cpu_delta(s0, server_cpu(gcs))
                res.add("gcs_save", label, tool, saved)
                stage = "gcs_load"
                s0 = server_cpu(gcs)
                got = summarize(runner.ranks("cloudckpt", "load", url, nbytes, R), "load")
                got["server_cpu_s"] = cpu_delta(s0, server_cpu(gcs))
                if not same(got["fingerprint"], saved["fingerprint"]):
                    raise RuntimeError("loaded state differs from the saved one")
                res.add("gcs_load", label, tool, got)
                log(f"  rep {rep} gcs cloudckpt save {saved['seconds']:6.2f}s  load {got['seconds']:6.2f}s")
            except Exception as e:  # noqa: BLE001 - reported as the row's error
                res.fail(stage, label, tool, "error", short_error(str(e)))
                log(f"  rep {rep} gcs cloudckpt FAILED: {short_error(str(e))}")



def populate_steps(s3, prefix: str, n: int) -> None:
    """``n`` committed steps, each with what both cloudckpt and OLMo-core look for:
    ``.metadata.json`` (a valid cloudckpt marker), ``model_and_optim/.metadata`` and
    ``train/rank0.pt`` (tiny stand-ins: discovery never opens them)."""
    from cloudckpt.checkpoint.entries import ObjectEntry
    from cloudckpt.checkpoint.marker import Marker

    c = s3.client()

    def one(step: int) -> None:
        objs = (ObjectEntry("model_and_optim/.metadata", 3, None), ObjectEntry("train/rank0.pt", 3, None))
        m = Marker(step=step, ephemeral=step % 10 != 0, world_size=2, objects=objs)
        base = f"{prefix}step{step}/"
        c.put_object(Bucket=BUCKET, Key=base + ".metadata.json", Body=m.to_bytes())
        c.put_object(Bucket=BUCKET, Key=base + "model_and_optim/.metadata", Body=b"md\n")
        c.put_object(Bucket=BUCKET, Key=base + "train/rank0.pt", Body=b"ts\n")

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(one, range(1, n + 1)))


def _listed_steps(out: str) -> int:
    """Steps in ``cloudckpt list --json`` output: JSON Lines (one object per step) in this
    version, one document with a ``steps`` list in older ones."""
    lines = [json.loads(ln) for ln in out.splitlines() if ln.strip()]
    if len(lines) == 1 and "steps" in lines[0]:
        return len(lines[0]["steps"])
    return sum(1 for d in lines if d.get("type") == "step")


def case_discovery(args, runner: Runner, res: Results, s3, log) -> None:
    from bench.ranks import HttpCounter
    from cloudckpt import cli
    from cloudckpt.checkpoint import discovery
    from cloudckpt.storage import clear_cache

    n = args.discovery_steps
    label = f"{n} steps"
    prefix = f"disc{n}/"
    url = f"s3://{BUCKET}/{prefix}".rstrip("/")
    t0 = time.perf_counter()
    populate_steps(s3, prefix, n)
    log(f"  wrote {n} committed steps in {time.perf_counter() - t0:.1f}s")
    counter = HttpCounter.install()
    want = f"{url}/step{n}"
    variants = [("latest", {})]  # a listing (saves no longer write a `latest` pointer: docs/protocol.md)
    for rep in range(args.reps):
        for case, kw in variants:
            clear_cache()  # a fresh client per run, like a new process
            n0, t0 = counter.n, time.perf_counter()
            found = discovery.latest_checkpoint(url, **kw)
            dt = time.perf_counter() - t0
            if found.rstrip("/") != want:
                raise RuntimeError(f"latest_checkpoint({kw}) found {found}, expected {want}")
            res.add(case, label, "cloudckpt", {"seconds": dt, "requests": counter.n - n0})
        clear_cache()
        buf = io.StringIO()
        n0, t0 = counter.n, time.perf_counter()
        with contextlib.redirect_stdout(buf):
            rc = cli.main(["list", url, "--json"])
        dt = time.perf_counter() - t0
        listed = _listed_steps(buf.getvalue())
        if rc != 0 or listed != n:
            raise RuntimeError(f"cloudckpt list exited {rc} and listed {listed} steps, expected {n}")
        res.add("list", label, "cloudckpt", {"seconds": dt, "requests": counter.n - n0})
        # the real command, with interpreter start-up and imports
        exe = Path(sys.executable).parent / "cloudckpt"
        t0 = time.perf_counter()
        p = subprocess.run([str(exe), "list", url], env=runner.env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"cloudckpt list failed: {short_error(p.stderr)}")
        res.add("list_cli", label, "cloudckpt", {"seconds": time.perf_counter() - t0})
        log(f"  rep {rep} cloudckpt latest {res.samples[('latest', label, 'cloudckpt')][-1]['seconds']:.2f}s "
            f"list {res.samples[('list', label, 'cloudckpt')][-1]['seconds']:.2f}s")
    if "olmo" in args.tools_list:
        py, why = runner.peer_python("olmo")
        if py is None:
            res.fail("latest", label, "olmo", "not installed", why)
        else:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            try:
                p = subprocess.run([py, str(ROOT / "bench" / "peers" / "olmo.py"), "latest", url,
                                    "--reps", str(args.reps), "--out", out],
                                   env=runner.env, cwd=ROOT, capture_output=True, text=True)
                r = json.loads(Path(out).read_text()) if Path(out).stat().st_size else {"ok": False, "error": p.stderr}
            finally:
                Path(out).unlink(missing_ok=True)
            if not r.get("ok"):
                res.fail("latest", label, "olmo", "error", short_error(r.get("error", "")))
            else:
                for run in r["runs"]:
                    if run["found"].rstrip("/") != want:
                        res.fail("latest", label, "olmo", "error", f"found {run['found']}, expected {want}")
                        break
                    res.add("latest", label, "olmo", {"seconds": run["seconds"], "requests": run["requests"]})
                log(f"  OLMo-core latest_checkpoint: {[round(x['seconds'], 2) for x in r['runs']]} s")
    if not args.keep:
        delete_prefix(s3, prefix)


def run_cases(args, cases: set[str], gcs_sizes: list[int], res: Results, log, partial) -> str | None:
    """Every case of ``cases`` (save_load, gcs, discovery) for ``args.sizes`` on one
    SeaweedFS (and one fake-gcs-server for gcs), recording into ``res``; ``partial(label)``
    after each save/load size. Returns the discovery label ("N steps") or None."""
    from cloudckpt.testing.servers import FakeGCS, SeaweedFS

    t_start = time.perf_counter()
    disc_label = None
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(SeaweedFS())
        s3.create_bucket(BUCKET)
        env = dict(os.environ, **s3.env())
        gcs = None
        if "gcs" in cases:
            gcs = stack.enter_context(FakeGCS())
            gcs.create_bucket(BUCKET)
            env.update(gcs.env())
        os.environ.update(env)  # the in-process discovery case and the GCS client
        runner = Runner(args, env)
        copies = LocalCopies(args, runner)
        stack.callback(copies.close)
        if "save_load" in cases:
            if not args.smoke:
                # the largest size, not less: SeaweedFS grows volumes on its first writes. With
                # a 1 GiB warm-up the first 4 GiB tool's save took 38.7 s against 29.0 s in its
                # next slot; with a full one, 34.5 against 29.8 (bench/NOTES.md)
                log(f"warm-up: {time.perf_counter() - t_start:.0f}s to start; uploading "
                    f"{size_label(max(args.sizes))} once, untimed")
                log(f"warm-up took {warm_up(s3, max(args.sizes), args.tmp):.1f}s")
            for nbytes in args.sizes:
                log(f"== save/load, {size_label(nbytes)}")
                case_save_load(args, runner, res, s3, nbytes, args.tools_list, log, copies)
                if nbytes not in gcs_sizes or gcs is None:
                    copies.drop(nbytes)
                partial(disc_label)
        if gcs is not None:
            for nbytes in gcs_sizes:
                log(f"== GCS (fake-gcs-server), {size_label(nbytes)}")
                case_gcs(args, runner, res, gcs, nbytes, log, copies)
                copies.drop(nbytes)
        if "discovery" in cases:
            log(f"== discovery over {args.discovery_steps} committed steps")
            disc_label = f"{args.discovery_steps} steps"
            case_discovery(args, runner, res, s3, log)
    return disc_label
