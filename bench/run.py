"""cloudckpt against its peers, side by side, in one run on one machine:
save, load (streaming, pre-download, resharded), GCS, and discovery.

    .venv/bin/python -m bench.run                      # 1 GiB and 4 GiB, median of 3
    .venv/bin/python -m bench.run --sizes 1GiB --reps 5
    .venv/bin/python -m bench.run --smoke              # tiny sizes, one repetition
    bash bench/setup_peers.sh                          # the peers' venvs (once)

It starts SeaweedFS (S3) and fake-gcs-server on 127.0.0.1, runs every case
``--reps`` times (tools in a rotated order each repetition, so none always goes
first; dirty pages flushed to disk, untimed, before every timed operation, so no
tool pays for the kernel writing back what an earlier one wrote), and writes to
``--out-dir`` (default ``bench/results/``):
``bench.json`` (every raw figure, the command, the machine's load), ``bench.md``
(medians, ratios to the peers of the same run, targets met or missed) and
``bench.png`` (the chart). ``--smoke`` writes ``smoke.*`` instead.

Tools (each case on 2 spawned gloo ranks, DTensor-sharded model + Adam state):
- cloudckpt (this venv) — ``Checkpointer.save`` / ``load`` (streaming, ``pre_download``, 2 -> 1);
- OLMo-core, s3torchconnector, DCP fsspec + s3fs — each in its own venv
  ``.venv-bench-{olmo,s3tc,fsspec}`` (``bench/setup_peers.sh``), run by ``bench/peers/launch.py``;
  a peer whose venv is missing is a "not installed" row; one that fails is an "error" row
  with the reason;
- s5cmd copying the same DCP bytes already on local disk (written by stock
  ``FileSystemWriter``): the upload / download ceiling of this machine. s5cmd also
  downloads those bytes right after every cloudckpt load (a copy uploaded once per
  size, untimed), and the load targets are judged on these pairs (median of the
  per-repetition ratios): single operations of one tool move by 15-20 % over the
  minutes between the separate rows, and the pair sees the same machine state. The
  unpaired ratio (medians of the separate rows) is reported beside it;
- GCS: cloudckpt against fake-gcs-server, and google-cloud-storage's
  ``transfer_manager`` copying the same files (the GCS ceiling);
- discovery over ``--discovery-steps`` committed steps: ``latest_checkpoint`` and
  ``cloudckpt list`` (in-process, HTTP requests counted at botocore's HTTP layer),
  and OLMo-core's ``Checkpointer.latest_checkpoint``.

Throughput is state bytes (fp32 tensor bytes, all ranks) / wall time of the
slowest rank between two barriers, MB = 10**6 bytes. This is a benchmark, not
a test: it asserts only that what was loaded matches what was saved.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
GiB = 1024 * MiB
BUCKET = "bench"

PEERS = {
    "olmo": "OLMo-core",
    "s3tc": "s3torchconnector",
    "fsspec": "DCP fsspec+s3fs",
}
LABELS = {"cloudckpt": "cloudckpt", "s5cmd": "s5cmd (ceiling)", "gcs_tm": "gcs transfer_manager (ceiling)", **PEERS}
# save targets: cloudckpt / peer >= x
SAVE_TARGETS = {"s5cmd": 0.9, "olmo": 1.3, "s3tc": 1.1}
LOAD_TARGET_S5CMD = 0.9
RSS_TARGET = 1.3
DISCOVERY_CASES = {"latest": "latest_checkpoint", "latest_list": "latest_checkpoint(use_pointer=False): listing",
                   "list": "`cloudckpt list` (in-process)", "list_cli": "`cloudckpt list` (command, incl. start-up)"}


def parse_size(text: str) -> int:
    t = text.strip().lower().replace("ib", "").replace("b", "")
    mult = {"k": 1024, "m": MiB, "g": GiB}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "kmg" else t) * mult)


def size_label(n: int) -> str:
    if n % GiB == 0:
        return f"{n // GiB}GiB"
    if n % MiB == 0:
        return f"{n // MiB}MiB"
    return f"{n}B"


_LOAD_SAMPLES: list[float] = []


def _sample_load(stop) -> None:
    while not stop.wait(10.0):
        with contextlib.suppress(OSError):
            _LOAD_SAMPLES.append(os.getloadavg()[0])


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def s5cmd_binary() -> str | None:
    cand = Path(sys.executable).parent / "s5cmd"
    return str(cand) if cand.exists() else shutil.which("s5cmd")


# ============================================================ results
class Results:
    """Raw samples per (case, size, tool) and rows that could not run."""

    def __init__(self):
        self.samples: dict[tuple[str, str, str], list[dict]] = {}
        self.status: dict[tuple[str, str, str], tuple[str, str]] = {}

    def add(self, case, size, tool, sample: dict) -> None:
        self.samples.setdefault((case, size, tool), []).append(sample)
        self.status.setdefault((case, size, tool), ("ok", ""))

    def fail(self, case, size, tool, status: str, reason: str) -> None:
        self.status[(case, size, tool)] = (status, reason)

    def median(self, case, size, tool, field="seconds"):
        vals = [s[field] for s in self.samples.get((case, size, tool), []) if s.get(field) is not None]
        return statistics.median(vals) if vals else None

    def rows(self) -> list[dict]:
        out = []
        for key in sorted(set(self.samples) | set(self.status), key=lambda k: (k[1], k[0], k[2])):
            case, size, tool = key
            status, reason = self.status.get(key, ("ok", ""))
            ss = self.samples.get(key, [])
            row = {"case": case, "size": size, "tool": tool, "status": status if not (status == "ok" and not ss) else "no data",
                   "reason": reason, "n": len(ss), "samples": ss}
            if ss:
                med = self.median(case, size, tool)
                row["median_seconds"] = med
                nbytes = ss[0].get("bytes")
                row["bytes"] = nbytes
                row["mb_per_s"] = nbytes / med / 1e6 if nbytes and med else None
                for f in ("rss_ratio", "requests", "objects", "client_cpu_s", "server_cpu_s"):
                    m = self.median(case, size, tool, f)
                    if m is not None:
                        row[f] = m
            out.append(row)
        return out


def _short(err: str, n: int = 300) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    interesting = [line for line in lines if ("Error" in line or "Exception" in line) and not line.startswith(" ")]
    # a rank that crashed makes the others fail with gloo's "Connection closed by peer": show the cause
    causes = [line for line in interesting if "Connection closed by peer" not in line]
    interesting = causes or interesting
    text = (interesting[0] if causes else interesting[-1]) if interesting else (lines[-1] if lines else err)
    text = text.strip()
    return text[:n]


# ============================================================ running one case
class Runner:
    def __init__(self, args, env: dict):
        self.args = args
        self.env = env
        self.venv_root = Path(args.peer_venvs)

    def peer_python(self, tool: str) -> tuple[str | None, str]:
        venv = self.venv_root / f".venv-bench-{tool}"
        py = venv / "bin" / "python"
        if not py.exists():
            return None, f"no {venv.name} (run: bash bench/setup_peers.sh {tool})"
        if not (venv / ".bench-installed").exists():
            log = self.venv_root / ".venv-bench-logs" / f"setup-{tool}.log"
            tail = _short(log.read_text(errors="replace")) if log.exists() else "set-up did not finish"
            return None, f"{venv.name} set-up failed: {tail}"
        return str(py), ""

    def ranks(self, tool: str, op: str, url: str, nbytes: int, ranks: int, saved_ranks: int | None = None,
              **extra) -> list[dict]:
        args = {"tool": tool, "op": op, "url": url, "bytes": nbytes, "saved_ranks": saved_ranks or ranks, **extra}
        settle()
        if tool in ("cloudckpt", "dcp_local"):
            from bench.ranks import cloudckpt_case
            from cloudckpt.testing.multiprocess import RankFailed, run_ranks

            try:
                return run_ranks(ranks, cloudckpt_case, args, env=self.env, timeout=self.args.timeout)
            except RankFailed as e:
                raise RuntimeError(_short(str(e))) from None
        py, why = self.peer_python(tool)
        if py is None:
            raise FileNotFoundError(why)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        try:
            argv = [py, str(ROOT / "bench" / "peers" / "launch.py"), "--tool", tool, "--op", op, "--url", url,
                    "--bytes", str(nbytes), "--ranks", str(ranks), "--timeout", str(self.args.timeout), "--out", out]
            p = subprocess.run(argv, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=self.args.timeout + 60)
            try:
                res = json.loads(Path(out).read_text())
            except (OSError, ValueError):
                raise RuntimeError(f"{tool} exited with {p.returncode}: {_short(p.stderr)}") from None
            if not res.get("ok"):
                raise RuntimeError(_short(res.get("error", "")))
            return res["ranks"]
        finally:
            Path(out).unlink(missing_ok=True)


def summarize(ranks: list[dict], op: str) -> dict:
    """One sample from every rank's figures."""
    secs = max(r["seconds"] for r in ranks)
    total = sum(r["local_bytes"] for r in ranks)
    s = {"seconds": secs, "bytes": total, "fingerprint": ranks[0]["fingerprint"], "per_rank": ranks}
    reqs = [r.get("requests") for r in ranks]
    s["requests"] = sum(reqs) if all(x is not None for x in reqs) else None
    if op == "load":
        s["rss_ratio"] = max(r["peak_rss_above_baseline"] / r["local_bytes"] for r in ranks)
        s["peak_rss_above_baseline"] = max(r["peak_rss_above_baseline"] for r in ranks)
    else:
        s["peak_rss_above_state"] = max(r["peak_rss_above_state"] for r in ranks)
    if ranks[0].get("objects") is not None:
        s["objects"] = ranks[0]["objects"]
    cpu = [r.get("cpu_s") for r in ranks]
    if all(x is not None for x in cpu):
        s["client_cpu_s"] = sum(cpu)
    return s


def server_cpu(server) -> float | None:
    """CPU seconds (user + system) the server process has used so far."""
    try:
        with open(f"/proc/{server.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, IndexError, ValueError):
        return None


def _cpu_delta(before, after):
    return None if before is None or after is None else after - before


def same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


# ============================================================ S3 helpers
def s3_client(s3):
    return s3.client()


def delete_prefix(s3, prefix: str) -> None:
    c = s3_client(s3)
    keys = [{"Key": o["Key"]} for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", ())]
    for i in range(0, len(keys), 1000):
        c.delete_objects(Bucket=BUCKET, Delete={"Objects": keys[i:i + 1000], "Quiet": True})


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_s5cmd(args, env, argv_tail: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the s5cmd process)."""
    import resource

    exe = s5cmd_binary()
    settle()
    argv = [exe, "--endpoint-url", env["AWS_ENDPOINT_URL"], "--numworkers", str(args.s5cmd_numworkers), "cp",
            "--concurrency", str(args.s5cmd_concurrency), *argv_tail]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"s5cmd failed ({p.returncode}): {_short(p.stderr or p.stdout)}")
    return dt, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def s5cmd_download(args, env, prefix: str, nbytes: int) -> tuple[float, float]:
    """s5cmd's download of ``prefix`` into a fresh local folder (removed after):
    (wall seconds, CPU seconds); raises unless it got ``nbytes`` bytes."""
    dst = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-dl-", dir=args.tmp))
    try:
        down, cpu = run_s5cmd(args, env, [f"s3://{BUCKET}/{prefix}*", f"{dst}/"])
        got = dir_bytes(dst)
        if got != nbytes:
            raise RuntimeError(f"s5cmd downloaded {got} bytes, expected {nbytes}")
        return down, cpu
    finally:
        shutil.rmtree(dst, ignore_errors=True)


# ============================================================ cases
def settle() -> None:
    """Flush dirty pages to disk before a timed operation (untimed). What SeaweedFS
    (or a tool downloading to disk) writes sits in the page cache and the kernel
    writes it back ~30 s later (``vm.dirty_expire_centisecs``), during whatever runs
    then: before this, the first tool after the warm-up paid for the warm-up's
    gigabytes (its 4 GiB saves were 15-30 % slower than its next ones)."""
    os.sync()


def warm_up(s3, nbytes: int, tmp: str | None) -> float:
    """Upload and delete ``nbytes`` once, untimed: a fresh SeaweedFS allocates its
    volumes on the first writes, which would otherwise be charged to whichever tool
    goes first."""
    c = s3_client(s3)
    path = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-warm-", dir=tmp)) / "blob"
    t0 = time.perf_counter()
    try:
        chunk = min(nbytes, 64 * MiB)
        with open(path, "wb") as f:
            f.write(os.urandom(chunk))
        for i in range(max(1, nbytes // chunk)):
            c.upload_file(str(path), BUCKET, f"warmup/{i}")
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    delete_prefix(s3, "warmup/")
    return time.perf_counter() - t0


class LocalCopies:
    """The state of each size as stock DCP files on local disk (``FileSystemWriter``):
    the bytes the s5cmd and transfer_manager rows copy. Written once per size."""

    def __init__(self, args, runner: Runner):
        self.args, self.runner = args, runner
        self.dirs: dict[int, tuple[Path, dict]] = {}

    def get(self, nbytes: int) -> tuple[Path, dict]:
        if nbytes not in self.dirs:
            src = Path(tempfile.mkdtemp(prefix=f"cloudckpt-bench-src-{size_label(nbytes)}-", dir=self.args.tmp))
            fp = summarize(self.runner.ranks("dcp_local", "save", str(src / "model_and_optim"), nbytes, self.args.ranks), "save")
            self.dirs[nbytes] = (src, fp)
        return self.dirs[nbytes]

    def drop(self, nbytes: int) -> None:
        src, _ = self.dirs.pop(nbytes, (None, None))
        if src is not None:
            shutil.rmtree(src, ignore_errors=True)

    def close(self) -> None:
        for n in list(self.dirs):
            self.drop(n)


def case_save_load(args, runner: Runner, res: Results, s3, nbytes: int, tools: list[str], log, copies: LocalCopies) -> None:
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
                                                  "client_cpu_s": up_cpu, "server_cpu_s": _cpu_delta(c0, server_cpu(s3))})
                c0 = server_cpu(s3)
                down, down_cpu = s5cmd_download(args, runner.env, prefix, nb)
                c1 = server_cpu(s3)
                res.add("load", label, "s5cmd", {"seconds": down, "bytes": src_fp["bytes"], "file_bytes": nb,
                                                  "client_cpu_s": down_cpu, "server_cpu_s": _cpu_delta(c0, c1)})
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
                saved["server_cpu_s"] = _cpu_delta(c0, server_cpu(s3))
            except Exception as e:  # noqa: BLE001 - reported as the row's error
                res.fail("save", label, tool, "error", _short(str(e)))
                res.fail("load", label, tool, "error", "save failed")
                log(f"  rep {rep} {tool:11s} save FAILED: {_short(str(e))}")
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
                    got["server_cpu_s"] = _cpu_delta(c0, server_cpu(s3))
                    if not same(got["fingerprint"], saved["fingerprint"]):
                        raise RuntimeError(f"loaded state differs from the saved one (fingerprint {got['fingerprint']} "
                                           f"!= {saved['fingerprint']})")
                except Exception as e:  # noqa: BLE001 - reported as the row's error
                    res.fail(case, label, tool, "error", _short(str(e)))
                    line += f"  {case} FAILED: {_short(str(e))}"
                    continue
                line += f"  {case} {got['seconds']:6.2f}s (rss x{got['rss_ratio']:.2f})"
                if paired and tool == "cloudckpt":
                    try:
                        got["s5cmd_paired_seconds"] = s5cmd_download(args, runner.env, paired, nb)[0]
                        line += f" s5cmd {got['s5cmd_paired_seconds']:5.2f}s"
                    except Exception as e:  # noqa: BLE001 - the pair is missing, the load's own figures stand
                        line += f" (paired s5cmd download FAILED: {_short(str(e))})"
                res.add(case, label, tool, got)
            log(line)
            if not args.keep:
                delete_prefix(s3, f"{tool}/{label}/rep{rep}/")


def case_gcs(args, runner: Runner, res: Results, gcs, nbytes: int, log, copies: LocalCopies) -> None:
    from bench.ranks import self_cpu  # torch, like every case (bench.run itself imports only the stdlib)

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
                settle()
                s0, c0, t0 = server_cpu(gcs), self_cpu(), time.perf_counter()
                out = tm.upload_many_from_filenames(bucket, files, source_directory=str(src), blob_name_prefix=prefix,
                                                    max_workers=args.gcs_workers, worker_type=tm.THREAD)
                up = time.perf_counter() - t0
                up_cpu = {"client_cpu_s": self_cpu() - c0, "server_cpu_s": _cpu_delta(s0, server_cpu(gcs))}
                bad = [r for r in out if isinstance(r, Exception)]
                if bad:
                    res.fail("gcs_save", label, tool, "error", _short(repr(bad[0])))
                    continue
                dst = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-gdl-", dir=args.tmp))
                try:
                    settle()
                    s0, c0, t0 = server_cpu(gcs), self_cpu(), time.perf_counter()
                    out = tm.download_many_to_path(bucket, files, destination_directory=str(dst), blob_name_prefix=prefix,
                                                   max_workers=args.gcs_workers, worker_type=tm.THREAD)
                    down = time.perf_counter() - t0
                    down_cpu = {"client_cpu_s": self_cpu() - c0, "server_cpu_s": _cpu_delta(s0, server_cpu(gcs))}
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
                saved["server_cpu_s"] = _cpu_delta(s0, server_cpu(gcs))
                res.add("gcs_save", label, tool, saved)
                stage = "gcs_load"
                s0 = server_cpu(gcs)
                got = summarize(runner.ranks("cloudckpt", "load", url, nbytes, R), "load")
                got["server_cpu_s"] = _cpu_delta(s0, server_cpu(gcs))
                if not same(got["fingerprint"], saved["fingerprint"]):
                    raise RuntimeError("loaded state differs from the saved one")
                res.add("gcs_load", label, tool, got)
                log(f"  rep {rep} gcs cloudckpt save {saved['seconds']:6.2f}s  load {got['seconds']:6.2f}s")
            except Exception as e:  # noqa: BLE001 - reported as the row's error
                res.fail(stage, label, tool, "error", _short(str(e)))
                log(f"  rep {rep} gcs cloudckpt FAILED: {_short(str(e))}")


def git_state() -> dict:
    """The commit measured, and which library files differed from it (others edit
    the tree while benchmarks run)."""
    def git(*a):
        p = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    dirty = git("status", "--porcelain", "--", "cloudckpt")
    return {"commit": git("rev-parse", "HEAD"), "dirty_library_files": dirty.splitlines() if dirty else []}


def populate_steps(s3, prefix: str, n: int) -> None:
    """``n`` committed steps, each with what both cloudckpt and OLMo-core look for:
    ``.metadata.json`` (a valid cloudckpt marker), ``model_and_optim/.metadata`` and
    ``train/rank0.pt`` (tiny stand-ins: discovery never opens them)."""
    from cloudckpt.checkpoint.marker import Marker, ObjectEntry

    c = s3_client(s3)

    def one(step: int) -> None:
        objs = (ObjectEntry("model_and_optim/.metadata", 3, None), ObjectEntry("train/rank0.pt", 3, None))
        m = Marker(step=step, ephemeral=step % 10 != 0, world_size=2, objects=objs)
        base = f"{prefix}step{step}/"
        c.put_object(Bucket=BUCKET, Key=base + ".metadata.json", Body=m.to_bytes())
        c.put_object(Bucket=BUCKET, Key=base + "model_and_optim/.metadata", Body=b"md\n")
        c.put_object(Bucket=BUCKET, Key=base + "train/rank0.pt", Body=b"ts\n")

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(one, range(1, n + 1)))


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
    # the ``latest`` pointer, as cloudckpt's saves leave it (when this version has one)
    pointer_ok = False
    try:
        import inspect

        from cloudckpt.checkpoint import pointer

        pointer.advance(url, n, pending=False)
        pointer_ok = "use_pointer" in inspect.signature(discovery.latest_checkpoint).parameters
    except (ImportError, AttributeError, TypeError) as e:
        log(f"  no latest pointer in this version ({type(e).__name__}): latest_checkpoint lists")
    variants = [("latest", {})] + ([("latest_list", {"use_pointer": False})] if pointer_ok else [])
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
        listed = len(json.loads(buf.getvalue())["steps"])
        if rc != 0 or listed != n:
            raise RuntimeError(f"cloudckpt list exited {rc} and listed {listed} steps, expected {n}")
        res.add("list", label, "cloudckpt", {"seconds": dt, "requests": counter.n - n0})
        # the real command, with interpreter start-up and imports
        exe = Path(sys.executable).parent / "cloudckpt"
        t0 = time.perf_counter()
        p = subprocess.run([str(exe), "list", url], env=runner.env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"cloudckpt list failed: {_short(p.stderr)}")
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
                p = subprocess.run([py, str(ROOT / "bench" / "peers" / "olmo.py"), "latest", url, "--reps", str(args.reps),
                                    "--out", out], env=runner.env, cwd=ROOT, capture_output=True, text=True)
                r = json.loads(Path(out).read_text()) if Path(out).stat().st_size else {"ok": False, "error": p.stderr}
            finally:
                Path(out).unlink(missing_ok=True)
            if not r.get("ok"):
                res.fail("latest", label, "olmo", "error", _short(r.get("error", "")))
            else:
                for run in r["runs"]:
                    if run["found"].rstrip("/") != want:
                        res.fail("latest", label, "olmo", "error", f"found {run['found']}, expected {want}")
                        break
                    res.add("latest", label, "olmo", {"seconds": run["seconds"], "requests": run["requests"]})
                log(f"  OLMo-core latest_checkpoint: {[round(x['seconds'], 2) for x in r['runs']]} s")
    if not args.keep:
        delete_prefix(s3, prefix)


# ============================================================ report
def ratio(a, b):
    return a / b if a and b else None


def paired_ratios(res: Results, case: str, size: str) -> list[float]:
    """cloudckpt's load throughput over s5cmd's download of the same state bytes right
    after it (same minute, same machine state), one ratio per repetition."""
    return [s["s5cmd_paired_seconds"] / s["seconds"] for s in res.samples.get((case, size, "cloudckpt"), [])
            if s.get("s5cmd_paired_seconds") and s.get("seconds")]


def analyse(res: Results, sizes: list[str], disc_label: str | None, judge: bool = True) -> tuple[list[dict], list[dict]]:
    """(ratios, targets) from the medians. ``judge=False`` (smoke sizes, where fixed
    costs dominate) reports the values but not met/missed."""
    ratios, targets = [], []

    def mbps(case, size, tool):
        s = res.samples.get((case, size, tool))
        med = res.median(case, size, tool)
        return s[0]["bytes"] / med / 1e6 if s and med else None

    for size in sizes:
        ours = mbps("save", size, "cloudckpt")
        for peer in ("s5cmd", "olmo", "s3tc", "fsspec"):
            r = ratio(ours, mbps("save", size, peer))
            ratios.append({"size": size, "what": f"save: cloudckpt / {LABELS[peer]}", "ratio": r})
            if peer in SAVE_TARGETS:
                targets.append({"size": size, "target": f"save >= {SAVE_TARGETS[peer]}x {LABELS[peer]}", "value": r,
                                "met": None if r is None else r >= SAVE_TARGETS[peer]})
        down = mbps("load", size, "s5cmd")
        for case, name in (("load", "streaming"), ("load_pre", "pre-download"), ("load_2to1", "resharded 2->1")):
            unpaired = ratio(mbps(case, size, "cloudckpt"), down)
            pairs = paired_ratios(res, case, size)
            if pairs:  # judged on the pairs: each load against s5cmd's download right after it
                ratios.append({"size": size, "what": f"load {name}: cloudckpt / s5cmd download, medians of the "
                               "separate rows (unpaired)", "ratio": unpaired})
                r, how = statistics.median(pairs), f" (median of {len(pairs)} paired ratios)"
            else:
                r, how = unpaired, ""
            targets.append({"size": size, "target": f"load {name} >= {LOAD_TARGET_S5CMD}x s5cmd download{how}",
                            "value": r, "met": None if r is None else r >= LOAD_TARGET_S5CMD})
            rss = res.median(case, size, "cloudckpt", "rss_ratio")
            targets.append({"size": size, "target": f"load {name}: peak RSS per rank <= {RSS_TARGET}x bytes loaded",
                            "value": rss, "met": None if rss is None else rss <= RSS_TARGET})
        for peer in ("olmo", "s3tc", "fsspec"):
            ratios.append({"size": size, "what": f"load (streaming): cloudckpt / {LABELS[peer]}",
                           "ratio": ratio(mbps("load", size, "cloudckpt"), mbps("load", size, peer))})
        for case in ("gcs_save", "gcs_load"):
            r = ratio(mbps(case, size, "cloudckpt"), mbps(case, size, "gcs_tm"))
            if r is not None:
                ratios.append({"size": size, "what": f"{case.replace('_', ' ')}: cloudckpt / {LABELS['gcs_tm']}", "ratio": r})
    if disc_label:
        ours, theirs = res.median("latest", disc_label, "cloudckpt"), res.median("latest", disc_label, "olmo")
        if ours and theirs:
            ratios.append({"size": disc_label, "what": "latest_checkpoint: OLMo-core time / cloudckpt time", "ratio": theirs / ours})
    if not judge:
        for t in targets:
            t["met"] = None
    return ratios, targets


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def _run_header(meta: dict) -> list[str]:
    during = meta.get("load_1min_during") or {}
    load = (f"1-min load average during the run: median {during['median']:.1f}, max {during['max']:.1f} "
            f"({during['samples']} samples)") if during else "load during the run not sampled"
    return [f"Command: `{meta['command']}`  ", f"When: {meta['when']}; machine: {meta['machine']['cpus']} cores; "
            f"load average before {meta['load_before']}, after {meta['load_after']}; {load}; "
            f"median of {meta['reps']} repetition(s) of the sizes {', '.join(meta['sizes'])}, {meta['ranks']} ranks; "
            f"commit {(meta.get('git') or {}).get('commit', '?')[:10]}"
            f"{' (library files modified in the work tree: ' + ', '.join(x.split()[-1] for x in meta['git']['dirty_library_files']) + ')' if (meta.get('git') or {}).get('dirty_library_files') else ''}."]


def markdown(meta: dict, rows: list[dict], ratios: list[dict], targets: list[dict]) -> str:
    out = []
    for run in meta.get("runs") or [meta]:
        out += _run_header(run) + ([f"Note: {run['note']}"] if run.get("note") else []) + [""]
    out += ["MB = 10^6 bytes; throughput = state bytes / wall time of the slowest rank. Server CPU: SeaweedFS's "
            "for S3 rows, fake-gcs-server's for GCS rows.", ""]
    out += ["| case | size | tool | median s | MB/s | peak RSS / bytes loaded | HTTP requests | client CPU s | "
            "server CPU s | runs | status |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["case"] in DISCOVERY_CASES:
            continue
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**: {r['reason']}"
        out.append(f"| {r['case']} | {r['size']} | {LABELS.get(r['tool'], r['tool'])} | {fmt(r.get('median_seconds'))} | "
                   f"{fmt(r.get('mb_per_s'), '.0f')} | {fmt(r.get('rss_ratio'))} | {fmt(r.get('requests'), '.0f')} | "
                   f"{fmt(r.get('client_cpu_s'), '.1f')} | {fmt(r.get('server_cpu_s'), '.1f')} | {r['n']} | {status} |")
    disc = [r for r in rows if r["case"] in DISCOVERY_CASES]
    if disc:
        out += ["", "| discovery | over | tool | median s | HTTP requests | runs | status |", "|---|---|---|---:|---:|---:|---|"]
        names = DISCOVERY_CASES
        for r in disc:
            status = r["status"] if r["status"] == "ok" else f"**{r['status']}**: {r['reason']}"
            out.append(f"| {names[r['case']]} | {r['size']} | {LABELS.get(r['tool'], r['tool'])} | {fmt(r.get('median_seconds'), '.3f')} | "
                       f"{fmt(r.get('requests'), '.0f')} | {r['n']} | {status} |")
    if ratios:
        out += ["", "| ratio (higher is better for cloudckpt) | size | value |", "|---|---|---:|"]
        out += [f"| {r['what']} | {r['size']} | {fmt(r['ratio'])} |" for r in ratios]
    if targets:
        out += ["", "| target | size | measured | met |", "|---|---|---:|---|"]
        out += [f"| {t['target']} | {t['size']} | {fmt(t['value'], '.3f')} | "
                f"{'not judged' if t['met'] is None else ('yes' if t['met'] else '**no**')} |" for t in targets]
    return "\n".join(out) + "\n"


def chart(path: Path, rows: list[dict], sizes: list[str], disc_label: str | None, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (bash bench/setup_peers.sh installs it): no chart"
    cases = [("save", "save"), ("load", "load"), ("load_pre", "load\npre-download"), ("load_2to1", "load\n2->1"),
             ("gcs_save", "GCS save"), ("gcs_load", "GCS load")]
    tools = ["cloudckpt", "s5cmd", "olmo", "s3tc", "fsspec", "gcs_tm"]
    colors = {"cloudckpt": "#1f77b4", "s5cmd": "#7f7f7f", "olmo": "#ff7f0e", "s3tc": "#2ca02c", "fsspec": "#d62728",
              "gcs_tm": "#9467bd"}
    by = {(r["case"], r["size"], r["tool"]): r for r in rows}
    panels = len(sizes) + (1 if disc_label else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        present = [c for c in cases if any((c[0], size, t) in by and by[(c[0], size, t)].get("mb_per_s") for t in tools)]
        here = [t for t in tools if any(by.get((c, size, t), {}).get("mb_per_s") for c, _ in present)]
        width = 0.8 / max(1, len(here))
        for i, tool in enumerate(here):
            xs, ys = [], []
            for j, (c, _) in enumerate(present):
                r = by.get((c, size, tool))
                if r and r.get("mb_per_s"):
                    xs.append(j + (i - len(here) / 2 + 0.5) * width)
                    ys.append(r["mb_per_s"])
            if xs:
                ax.bar(xs, ys, width, label=LABELS[tool], color=colors[tool])
        ax.set_xticks(range(len(present)), [name for _, name in present], fontsize=8)
        ax.set_ylabel("MB/s (median; higher is better)")
        ax.set_title(f"{size} state, 2 ranks")
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    if disc_label:
        ax = axes[0][-1]
        items = [(f"{LABELS[r['tool']]}\n{r['case']}", r) for r in rows
                 if r["case"] in ("latest", "latest_list", "list") and r["size"] == disc_label and r.get("requests") is not None]
        ax.bar(range(len(items)), [r["requests"] for _, r in items], color=[colors[r["tool"]] for _, r in items])
        for k, (_, r) in enumerate(items):
            ax.annotate(f"{r['median_seconds']:.2f}s", (k, r["requests"]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(items)), [n for n, _ in items], fontsize=8)
        ax.set_yscale("log")
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("HTTP requests (log; labels: median seconds)")
        ax.set_title(f"discovery over {disc_label}")
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ============================================================ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None, help="comma-separated state sizes (default 1GiB,4GiB; smoke 4MiB)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per case, median reported (default 3; smoke 1)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cases", default="save_load,gcs,discovery", help="save_load, gcs, discovery")
    ap.add_argument("--tools", default="cloudckpt,s5cmd,olmo,s3tc,fsspec")
    ap.add_argument("--gcs-sizes", default=None, help="sizes for the GCS rows (default: the smallest of --sizes)")
    ap.add_argument("--gcs-workers", type=int, default=8)
    ap.add_argument("--discovery-steps", type=int, default=None, help="committed steps for discovery (default 1000; smoke 20)")
    ap.add_argument("--s5cmd-numworkers", type=int, default=256, help="s5cmd --numworkers (its default)")
    ap.add_argument("--s5cmd-concurrency", type=int, default=5, help="s5cmd cp --concurrency (its default)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition, smoke.* outputs")
    ap.add_argument("--peer-venvs", default=str(ROOT), help="folder holding .venv-bench-* (default: the repo)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tmp", default=None, help="folder for local copies (default: the system temp dir)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case before it counts as hung")
    ap.add_argument("--keep", action="store_true", help="keep uploaded objects (disk grows by every repetition)")
    ap.add_argument("--stem", default=None, help="output file names (default: bench, or smoke with --smoke)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="no run: combine the JSON of earlier runs (each size / case from one run) into one report")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.out_dir), args.stem or "bench")
    args.sizes = [parse_size(s) for s in (args.sizes or ("4MiB" if args.smoke else "1GiB,4GiB")).split(",") if s]
    args.reps = args.reps or (1 if args.smoke else 3)
    args.discovery_steps = args.discovery_steps or (20 if args.smoke else 1000)
    args.tools_list = [t for t in args.tools.split(",") if t]
    cases = set(c for c in args.cases.split(",") if c)
    gcs_sizes = [parse_size(s) for s in args.gcs_sizes.split(",")] if args.gcs_sizes else [min(args.sizes)]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.stem or ("smoke" if args.smoke else "bench")
    command = " ".join([".venv/bin/python -m bench.run"] + (sys.argv[1:] if argv is None else list(argv)))

    t_log = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_log:6.0f}s] {msg}", flush=True)

    from cloudckpt.testing.servers import FakeGCS, SeaweedFS

    load_before = loadavg()
    log(f"bench: sizes {[size_label(s) for s in args.sizes]}, reps {args.reps}, ranks {args.ranks}, "
        f"cases {sorted(cases)}, load average {load_before} on {os.cpu_count()} cores")
    res = Results()
    t_start = time.perf_counter()
    import threading

    stop_sampling = threading.Event()
    threading.Thread(target=_sample_load, args=(stop_sampling,), daemon=True).start()
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
                # next slot (bench-4GiB-s3); with a full one, 34.5 against 29.8 (-s3-warm)
                log(f"warm-up: {time.perf_counter() - t_start:.0f}s to start; uploading "
                    f"{size_label(max(args.sizes))} once, untimed")
                log(f"warm-up took {warm_up(s3, max(args.sizes), args.tmp):.1f}s")
            for nbytes in args.sizes:
                log(f"== save/load, {size_label(nbytes)}")
                case_save_load(args, runner, res, s3, nbytes, args.tools_list, log, copies)
                if nbytes not in gcs_sizes or gcs is None:
                    copies.drop(nbytes)
                write_outputs(args, res, disc_label, command, load_before, t_start, out_dir / f"{stem}.partial.json", log=None)
        if gcs is not None:
            for nbytes in gcs_sizes:
                log(f"== GCS (fake-gcs-server), {size_label(nbytes)}")
                case_gcs(args, runner, res, gcs, nbytes, log, copies)
                copies.drop(nbytes)
        if "discovery" in cases:
            log(f"== discovery over {args.discovery_steps} committed steps")
            disc_label = f"{args.discovery_steps} steps"
            case_discovery(args, runner, res, s3, log)
    stop_sampling.set()
    write_outputs(args, res, disc_label, command, load_before, t_start, out_dir / f"{stem}.json", log=log)
    (out_dir / f"{stem}.partial.json").unlink(missing_ok=True)
    return 0


def merge(paths: list[str], out_dir: Path, stem: str) -> int:
    """One report from several runs' JSON. Each (case, size, tool) keeps its own
    samples; ratios compare rows of the same size, so keep each size (and the GCS
    and discovery cases) within one run to keep the ratios same-run."""
    res, runs, sizes, disc_label = Results(), [], [], None
    for p in paths:
        d = json.loads(Path(p).read_text())
        runs.append({k: d.get(k) for k in ("command", "when", "reps", "ranks", "sizes", "load_before", "load_after",
                                           "load_1min_during", "wall_seconds", "git", "versions", "machine", "settings",
                                           "note")})
        for r in d["rows"]:
            key = (r["case"], r["size"], r["tool"])
            for sample in r["samples"]:
                res.add(*key, sample)
            if r["status"] in ("not installed", "error"):
                res.fail(*key, r["status"], r["reason"])
            if r["case"] in DISCOVERY_CASES:
                disc_label = r["size"]
            elif r["size"] not in sizes:
                sizes.append(r["size"])
    sizes.sort(key=parse_size)
    rows = res.rows()
    ratios, targets = analyse(res, sizes, disc_label)
    meta = {"merged_from": [str(p) for p in paths], "runs": runs}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows, "ratios": ratios, "targets": targets}, indent=1) + "\n")
    md = markdown(meta, rows, ratios, targets)
    (out_dir / f"{stem}.md").write_text(md)
    cmds = " + ".join(r["command"] for r in runs)
    problem = chart(out_dir / f"{stem}.png", rows, sizes, disc_label, f"{cmds}  |  {runs[0]['when']} .. {runs[-1]['when']}")
    print(md)
    if problem:
        print(f"chart: {problem}")
    print(f"wrote {out_dir / stem}.json, .md, .png")
    return 0


def write_outputs(args, res: Results, disc_label, command: str, load_before, t_start: float, json_path: Path, log) -> None:
    """The JSON (always); with ``log``, also the markdown and the chart beside it."""
    load_after = loadavg()
    rows = res.rows()
    sizes = [size_label(s) for s in args.sizes]
    ratios, targets = analyse(res, sizes, disc_label, judge=not args.smoke)
    versions = {}
    for mod in ("torch", "boto3", "botocore", "google.cloud.storage"):
        with contextlib.suppress(Exception):
            versions[mod] = __import__(mod, fromlist=["__version__"]).__version__
    for tool in PEERS:
        freeze = Path(args.peer_venvs) / f".venv-bench-{tool}" / ".bench-freeze.txt"
        if freeze.exists():
            keep = ("ai2-olmo-core", "s3torchconnector", "s3fs", "fsspec", "aiobotocore", "botocore", "boto3", "torch")
            versions[tool] = [ln for ln in freeze.read_text().splitlines() if ln.split("==")[0].lower() in keep]
    if s5cmd_binary():
        versions["s5cmd"] = subprocess.run([s5cmd_binary(), "version"], capture_output=True, text=True).stdout.strip()
    meta = {
        "command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reps": args.reps,
        "ranks": args.ranks, "sizes": sizes, "load_before": load_before, "load_after": load_after,
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        "load_1min_during": ({"min": min(_LOAD_SAMPLES), "median": statistics.median(_LOAD_SAMPLES), "max": max(_LOAD_SAMPLES),
                              "samples": len(_LOAD_SAMPLES)} if _LOAD_SAMPLES else None),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "versions": versions,
        "git": git_state(),
        "settings": {"s5cmd_numworkers": args.s5cmd_numworkers, "s5cmd_concurrency": args.s5cmd_concurrency,
                     "gcs_workers": args.gcs_workers, "discovery_steps": args.discovery_steps},
    }
    json_path.write_text(json.dumps({**meta, "rows": rows, "ratios": ratios, "targets": targets}, indent=1) + "\n")
    if log is None:
        return
    md = markdown(meta, rows, ratios, targets)
    json_path.with_suffix(".md").write_text(md)
    problem = chart(json_path.with_suffix(".png"), rows, sizes, disc_label,
                    f"{command}  |  {meta['when']}  |  load avg {load_before} -> {load_after} on {os.cpu_count()} cores")
    log("\n" + md)
    if problem:
        log(f"chart: {problem}")
    log(f"wrote {json_path.with_suffix('')}.json, .md, .png in {meta['wall_seconds']}s")


if __name__ == "__main__":
    sys.exit(main())
