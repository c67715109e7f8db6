"""Where SeaweedFS spends its CPU during a save or a load, for cloudckpt and the
peers: on this machine the store's CPU is the save's ceiling and part of every
load (docs/performance.md), so this says what that CPU does and whether a
client's request shape changes it.

One SeaweedFS on 127.0.0.1; for every tool a 2-rank save or load of the bench
state (as ``bench.run`` does it; a load's state is saved first, unprofiled), with
``perf record`` sampling only the SeaweedFS process.
Samples in the ``weed`` binary (a stripped Go program) are named from its
``.gopclntab`` (the table the Go runtime itself uses for stack traces); kernel
samples keep perf's names. Prints, and with ``--out`` writes as JSON, each
tool's wall time, SeaweedFS CPU seconds and its samples by kind (MD5, CRC32,
memory copies, Go runtime, kernel) with the top functions.

    .venv/bin/python -m bench.server_profile --size 1GiB --tools cloudckpt,s5cmd,s3tc
    .venv/bin/python -m bench.server_profile --op load --tools cloudckpt,cloudckpt-pre,s5cmd

Needs ``perf`` (linux-tools) and the right to profile the process (root, or
``kernel.perf_event_paranoid`` <= 1); without them it stops and says so.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.ab_load import MODES

ROOT = Path(__file__).resolve().parent.parent

KINDS = [  # (kind, test on a function name); first match wins, kernel samples are "kernel"
    ("md5", lambda n: n.startswith("crypto/md5.")),
    ("crc32", lambda n: n.startswith("hash/crc32.")),
    ("sha256", lambda n: n.startswith("crypto/sha256.") or n.startswith("crypto/internal/fips140/sha256.")),
    ("memmove/memclr", lambda n: n.startswith("runtime.mem")),
    ("go runtime", lambda n: n.startswith("runtime.") or n.startswith("internal/runtime/")),
]


class GoSymbols:
    """Function names of a Go (1.18+) executable from its ``.gopclntab``, even when
    the binary is stripped: ``name(address)`` for a virtual address in ``.text``."""

    def __init__(self, path: str):
        data = Path(path).read_bytes()
        if data[:4] != b"\x7fELF" or data[4] != 2:
            raise ValueError(f"{path} is not a 64-bit ELF file")
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        sections = {}
        headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
        strtab_off = headers[shstrndx][4]
        for name_off, _type, _flags, addr, off, size in headers:
            name = data[strtab_off + name_off: data.index(b"\0", strtab_off + name_off)].decode()
            sections[name] = (addr, off, size)
        if ".gopclntab" not in sections or ".text" not in sections:
            raise ValueError(f"{path} has no .gopclntab/.text section (not a Go executable?)")
        _, off, size = sections[".gopclntab"]
        tab = data[off: off + size]
        magic, = struct.unpack_from("<I", tab, 0)
        if magic not in (0xFFFFFFF0, 0xFFFFFFF1):  # Go 1.18-1.19, 1.20+
            raise ValueError(f"{path}: unknown pclntab magic {magic:#x} (Go older than 1.18?)")
        nfunc, _nfiles, text_start, funcname_off, _cu, _filetab, _pctab, functab = struct.unpack_from("<8Q", tab, 8)
        base = text_start or sections[".text"][0]  # 0 in the file: the runtime sets it to .text's address
        entries = []
        for i in range(nfunc):
            entry, func = struct.unpack_from("<II", tab, functab + 8 * i)
            name_off, = struct.unpack_from("<i", tab, functab + func + 4)
            s = funcname_off + name_off
            entries.append((base + entry, tab[s: tab.index(b"\0", s)].decode(errors="replace")))
        entries.sort()
        self._starts = [a for a, _ in entries]
        self._names = [n for _, n in entries]

    def name(self, addr: int) -> str | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        return self._names[i] if i >= 0 else None

    def address(self, name: str) -> int | None:
        try:
            return self._starts[self._names.index(name)]
        except ValueError:
            return None


def kind_of(name: str, kernel: bool) -> str:
    if kernel:
        return "kernel"
    for kind, test in KINDS:
        if test(name):
            return kind
    return "other"


class Perf:
    """``perf record`` of one process between ``start`` and ``stop``; ``stop`` returns
    the samples counted by function (``(function, is_kernel)`` -> samples)."""

    def __init__(self, pid: int, go_binary: str, freq: int = 997):
        self.pid, self.syms, self.freq = pid, GoSymbols(go_binary), freq
        self.data = ""
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.data = os.path.join(tempfile.mkdtemp(prefix="cloudckpt-perf-"), "perf.data")
        self.proc = subprocess.Popen(["perf", "record", "-q", "-F", str(self.freq), "-p", str(self.pid),
                                      "-o", self.data],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # perf attaches to every thread before the operation starts
        if self.proc.poll() is not None:
            raise RuntimeError(f"perf record failed: {self.proc.stderr.read().strip()[:300]}")

    def stop(self) -> collections.Counter:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)
        try:
            out = subprocess.run(["perf", "script", "-i", self.data, "-F", "ip,sym,dso"], capture_output=True,
                                 text=True, check=True).stdout
        finally:
            shutil.rmtree(os.path.dirname(self.data), ignore_errors=True)
        counts: collections.Counter = collections.Counter()
        for line in out.splitlines():
            parts = line.split()
            if not parts:
                continue
            dso = parts[-1].strip("()")
            kernel = "kernel" in dso
            try:
                ip = int(parts[0], 16)
            except ValueError:
                continue
            name = " ".join(parts[1:-1]) if kernel else (self.syms.name(ip) or "?")
            counts[(name, kernel)] += 1
        return counts


def summary(counts: collections.Counter, top: int = 12) -> dict:
    total = sum(counts.values()) or 1
    kinds: collections.Counter = collections.Counter()
    for (name, kernel), n in counts.items():
        kinds[kind_of(name, kernel)] += n
    return {"samples": sum(counts.values()),
            "share": {k: kinds[k] / total for k in [k for k, _ in KINDS] + ["other", "kernel"]},
            "top": [{"function": ("[k] " if kernel else "") + name, "share": n / total}
                    for (name, kernel), n in counts.most_common(top)]}


# (ranks, options)
LOADS = {"cloudckpt": MODES["stream"], "cloudckpt-pre": MODES["pre"], "cloudckpt-2to1": MODES["2to1"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=("save", "load"), default="save")
    ap.add_argument("--size", default="1GiB", help="state size (default 1GiB)")
    ap.add_argument("--tools", default="cloudckpt,s5cmd,s3tc",
                    help="of cloudckpt, s5cmd, olmo, s3tc, fsspec; for loads also cloudckpt-pre, cloudckpt-2to1")
    ap.add_argument("--reps", type=int, default=1, help="operations per tool (profiled together)")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args(argv)
    if shutil.which("perf") is None:
        print("bench.server_profile needs perf (linux-tools) on PATH", file=sys.stderr)
        return 2
    from bench.common import BUCKET, parse_size
    from bench.drivers import LocalCopies, Runner
    from bench.measure import delete_prefix, run_s5cmd, s5cmd_binary, server_cpu
    from cloudckpt.testing.servers import SeaweedFS, weed_binary

    nbytes = parse_size(a.size)
    tools = [t for t in a.tools.split(",") if t]
    run_args = argparse.Namespace(peer_venvs=str(ROOT), timeout=1800.0, tmp=None, ranks=2, s5cmd_numworkers=256,
                                  s5cmd_concurrency=5)
    rows = []
    with SeaweedFS() as s3:
        s3.create_bucket(BUCKET)
        env = dict(os.environ, **s3.env())
        runner = Runner(run_args, env)
        copies = LocalCopies(run_args, runner)
        perf = Perf(s3.proc.pid, weed_binary())
        runner.ranks("cloudckpt", "save", f"s3://{BUCKET}/warm", nbytes, 2)  # volumes allocated, untimed
        delete_prefix(s3, "warm/")
        saved: set[str] = set()

        def source(tool: str) -> str:
            """Where ``tool``'s saved state is (for loads: saved once, untimed, not profiled)."""
            base = tool.split("-")[0]
            if base == "s5cmd":
                src = copies.get(nbytes)[0]
                if a.op == "load" and base not in saved:
                    run_s5cmd(run_args, env, [f"{src}/*", f"s3://{BUCKET}/s5cmd/src/"])
                saved.add(base)
                return str(src) if a.op == "save" else f"s3://{BUCKET}/s5cmd/src/"
            if a.op == "load" and base not in saved:
                runner.ranks(base, "save", f"s3://{BUCKET}/{base}/src", nbytes, 2)
            saved.add(base)
            return f"s3://{BUCKET}/{base}/src"

        def once(tool: str, rep: int, src: str) -> float:
            if tool == "s5cmd" and a.op == "save":
                return run_s5cmd(run_args, env, [f"{src}/*", f"s3://{BUCKET}/s5cmd/{rep}/"])[0]
            if tool == "s5cmd":
                dst = tempfile.mkdtemp(prefix="cloudckpt-profile-dl-")
                try:
                    return run_s5cmd(run_args, env, [f"{src}*", f"{dst}/"])[0]
                finally:
                    shutil.rmtree(dst, ignore_errors=True)
            if a.op == "save":
                got = runner.ranks(tool, "save", f"s3://{BUCKET}/{tool}/{rep}", nbytes, 2)
            else:
                ranks, extra = LOADS.get(tool, (2, {}))
                got = runner.ranks(tool.split("-")[0], "load", src, nbytes, ranks, saved_ranks=2, **extra)
            return max(r["seconds"] for r in got)

        try:
            for tool in tools:
                if tool.startswith("s5cmd") and s5cmd_binary() is None:
                    rows.append({"tool": tool, "error": "no s5cmd binary in the venv or on PATH"})
                    continue
                if "-" in tool and (a.op == "save" or tool not in LOADS):
                    rows.append({"tool": tool, "error": f"no {a.op} variant {tool!r} (load variants: {sorted(LOADS)})"})
                    continue
                try:
                    src = source(tool)
                    os.sync()
                    c0, seconds = server_cpu(s3), 0.0
                    perf.start()
                    try:
                        for rep in range(a.reps):
                            seconds += once(tool, rep, src)
                    finally:
                        counts = perf.stop()
                except Exception as e:  # noqa: BLE001 - a peer's failure is its row
                    rows.append({"tool": tool, "error": str(e)[:300]})
                    continue
                row = {"tool": tool, "seconds": seconds, "server_cpu_s": server_cpu(s3) - c0, **summary(counts)}
                rows.append(row)
                if a.op == "save":
                    delete_prefix(s3, f"{tool}/")
                sh = row["share"]
                print(f"{tool:14s} {a.op} {row['seconds']:6.2f}s  SeaweedFS {row['server_cpu_s']:5.2f} CPU-s, "
                      f"{row['samples']} samples: md5 {sh['md5']:.0%}  crc32 {sh['crc32']:.0%}  "
                      f"mem {sh['memmove/memclr']:.0%}  runtime {sh['go runtime']:.0%}  kernel {sh['kernel']:.0%}  "
                      f"other {sh['other']:.0%}", flush=True)
                for t in row["top"][:8]:
                    print(f"    {t['share']:6.1%}  {t['function']}")
        finally:
            copies.close()
    if a.out:
        command = " ".join([".venv/bin/python -m bench.server_profile"] + sys.argv[1:])
        Path(a.out).write_text(json.dumps({"command": command,
                                           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                           "op": a.op, "size": a.size, "reps": a.reps, "rows": rows}, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
