"""Rank 0's `.metadata` at a repeated save: uploaded again, or copied server-side.

    .venv/bin/python -m bench.metadata_copy                      # 411 MiB (1,024 ranks of the 70B shape), 3 reps
    .venv/bin/python -m bench.metadata_copy --bandwidth 100MiB   # rank 0's link capped, as a rank's share of a node's
    .venv/bin/python -m bench.metadata_copy --smoke              # 8 MiB, one rep

DCP's `.metadata` of a 70B model with AdamW is 411 MB at 1,024 ranks and about 1.6 GB at
4,096 (``bench/scale.py``'s ``finish`` phase). A repeated save's is the same bytes as the
last one's; cloudckpt's rank 0 copies the object it put at the last save instead of
uploading it again (``TransferEngine.submit_copy_or_upload``). This bench puts a file of
that size into the bucket, then transfers it to a new key both ways, alternating within
each rep, with the library's transfer engine: ``upload`` (``submit_upload``, what every
save did before) and ``copy`` (``submit_copy_or_upload``: a server-side copy). Per store
(SeaweedFS and fake-gcs-server on 127.0.0.1) and way: the seconds (median over reps) and
the bytes that crossed this process's link (the engine's ``bytes_uploaded``; a copy's
count as ``bytes_copied``). Each copy is checked against the file's bytes. With
``--bandwidth``, uploads are capped as rank 0's share of a node's link would be; copies
move no bytes through it. Results: ``bench/results/metadata_copy[-<bandwidth>ps].{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WAYS = ("upload", "copy")


def measure(root: str, path: str, size: int, crc: str, reps: int, bandwidth: int | None) -> dict:
    """Both ways ``reps`` times on the store at ``root``: ``{way: {"seconds": [...], "sent": [...]}}``."""
    from cloudckpt.storage import open_store
    from cloudckpt.transfer import TransferConfig, TransferEngine

    store = open_store(root)
    src = f"{root}/step1/model_and_optim/.metadata"
    config = TransferConfig(bandwidth_limit=bandwidth) if bandwidth else TransferConfig()
    out: dict = {way: {"seconds": [], "sent": [], "copied": []} for way in WAYS}
    with TransferEngine(config) as engine:
        engine.submit_upload(path, src, crc32c=crc).result()
        for rep in range(reps):
            for way in WAYS if rep % 2 == 0 else WAYS[::-1]:
                dst = f"{root}/step{2 + rep}-{way}/model_and_optim/.metadata"
                before = engine.stats()
                t0 = time.perf_counter()
                if way == "upload":
                    res = engine.submit_upload(path, dst, crc32c=crc).result()
                else:
                    res = engine.submit_copy_or_upload(src, path, dst, crc32c=crc).result()
                seconds = time.perf_counter() - t0
                after = engine.stats()
                info = store.stat(dst)
                if res.size != size or info.size != size:
                    raise SystemExit(f"{way} to {dst}: {info.size} bytes, not {size}")
                out[way]["seconds"].append(seconds)
                out[way]["sent"].append(after.bytes_uploaded - before.bytes_uploaded)
                out[way]["copied"].append(after.bytes_copied - before.bytes_copied)
                store.delete(dst)
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# Rank 0's `.metadata` at a repeated save: uploaded or copied server-side",
        "",
        f"`{meta['command']}`, {meta['when']}: a {meta['size_mib']:.0f} MiB file, {meta['reps']} reps each way "
        f"(alternating), the library's transfer engine; stores on 127.0.0.1 ({meta['cpus']} cores shared with "
        f"them); load average before {meta['load_before']}"
        + (f"; uploads capped at {meta['bandwidth']}/s." if meta["bandwidth"] else "; nothing capped (loopback)."),
        "",
        "| store | upload: s | copy: s | copy / upload | bytes sent by rank 0: upload | copy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['store']} | {r['upload_s']:.2f} | {r['copy_s']:.2f} | {r['ratio']:.2f} | "
                     f"{r['upload_sent']:,} | {r['copy_sent']:,} |")
    lines += ["", "Seconds are medians. A copy's bytes never cross rank 0's link (the engine counts them as "
              "`bytes_copied`); on loopback the store still reads and writes them on the same cores.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default=None, help="the .metadata's size (default 411MiB; smoke 8MiB)")
    ap.add_argument("--reps", type=int, default=None, help="transfers each way per store (default 3; smoke 1)")
    ap.add_argument("--bandwidth", default=None, help="rank 0's upload bandwidth, e.g. 100MiB (per second)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)

    from bench.common import git_state, loadavg, parse_size
    from cloudckpt.testing.servers import FakeGCS, SeaweedFS
    from cloudckpt.transfer.checksum import crc32c_file

    size = parse_size(a.size or ("8MiB" if a.smoke else "411MiB"))
    reps = a.reps or (1 if a.smoke else 3)
    bandwidth = parse_size(a.bandwidth) if a.bandwidth else None
    command = " ".join([".venv/bin/python -m bench.metadata_copy"] + (sys.argv[1:] if argv is None else list(argv)))
    meta = {"command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "size": size,
            "size_mib": size / 2**20, "reps": reps, "bandwidth": a.bandwidth, "load_before": loadavg(),
            "cpus": os.cpu_count(), "smoke": a.smoke, "git": git_state()}
    rows = []
    with tempfile.TemporaryDirectory(prefix="cloudckpt-metadata-copy-") as tmp:
        path = os.path.join(tmp, ".metadata")
        with open(path, "wb") as f:
            for _ in range(size // 2**20):
                f.write(os.urandom(2**20))
            f.write(os.urandom(size % 2**20))
        crc = crc32c_file(path)
        for name, server in (("SeaweedFS (S3)", SeaweedFS), ("fake-gcs-server (GCS)", FakeGCS)):
            s = server().start()
            try:
                os.environ.update(s.env())
                got = measure(s.create_bucket("metacopy") + "/run", path, size, crc, reps, bandwidth)
            finally:
                s.stop()
            up, cp = (statistics.median(got[w]["seconds"]) for w in WAYS)
            rows.append({"store": name, "upload_s": up, "copy_s": cp, "ratio": cp / up,
                         "upload_sent": max(got["upload"]["sent"]), "copy_sent": max(got["copy"]["sent"]),
                         "copied": min(got["copy"]["copied"]), "raw": got})
            if rows[-1]["copy_sent"] or rows[-1]["copied"] != size:
                raise SystemExit(f"{name}: the copy sent {rows[-1]['copy_sent']} bytes through rank 0's link")
    meta["load_after"] = loadavg()
    md = markdown(meta, rows)
    name = "metadata_copy" + ("_smoke" if a.smoke else "") + (f"-{a.bandwidth}ps" if a.bandwidth else "")
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(a.out_dir) / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (Path(a.out_dir) / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
