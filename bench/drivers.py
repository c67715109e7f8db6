"""Running one operation of one tool on spawned ranks: cloudckpt in this venv, each peer
in its own venv (``.venv-bench-{tool}``, made by ``bench/setup_peers.sh``) through
``bench/peers/launch.py``; and the state as stock DCP files on local disk, the bytes
the s5cmd and ``transfer_manager`` rows copy."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.common import ROOT, short_error, size_label
from bench.measure import settle, summarize

PEERS = {
    "olmo": "OLMo-core",
    "s3tc": "s3torchconnector",
    "fsspec": "DCP fsspec+s3fs",
}


class Runner:
    """Runs a case on ``ranks`` processes. ``args`` carries ``peer_venvs`` (the folder
    holding ``.venv-bench-*``) and ``timeout`` (seconds per case)."""

    def __init__(self, args, env: dict):
        self.args = args
        self.env = env
        self.venv_root = Path(args.peer_venvs)

    def peer_python(self, tool: str) -> tuple[str | None, str]:
        """(the peer venv's python, "") or (None, why it cannot run and how to set it up)."""
        venv = self.venv_root / f".venv-bench-{tool}"
        py = venv / "bin" / "python"
        if not py.exists():
            return None, f"no {venv.name} (run: bash bench/setup_peers.sh {tool})"
        if not (venv / ".bench-installed").exists():
            log = self.venv_root / ".venv-bench-logs" / f"setup-{tool}.log"
            tail = short_error(log.read_text(errors="replace")) if log.exists() else "set-up did not finish"
            return None, f"{venv.name} set-up failed: {tail}"
        return str(py), ""

    def ranks(self, tool: str, op: str, url: str, nbytes: int, ranks: int, saved_ranks: int | None = None,
              **extra) -> list[dict]:
        """Every rank's figures for one ``op`` (save / load) of ``tool`` on ``url``;
        raises with the failing rank's one-line error."""
        args = {"tool": tool, "op": op, "url": url, "bytes": nbytes, "saved_ranks": saved_ranks or ranks, **extra}
        settle()
        if tool in ("cloudckpt", "dcp_local"):
            from bench.ranks import cloudckpt_case
            from cloudckpt.testing.multiprocess import RankFailed, run_ranks

            try:
                return run_ranks(ranks, cloudckpt_case, args, env=self.env, timeout=self.args.timeout)
            except RankFailed as e:
                raise RuntimeError(short_error(str(e))) from None
        py, why = self.peer_python(tool)
        if py is None:
            raise FileNotFoundError(why)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        try:
            argv = [py, str(ROOT / "bench" / "peers" / "launch.py"), "--tool", tool, "--op", op, "--url", url,
                    "--bytes", str(nbytes), "--ranks", str(ranks), "--timeout", str(self.args.timeout), "--out", out]
            p = subprocess.run(argv, env=self.env, cwd=ROOT, capture_output=True, text=True,
                               timeout=self.args.timeout + 60)
            try:
                res = json.loads(Path(out).read_text())
            except (OSError, ValueError):
                raise RuntimeError(f"{tool} exited with {p.returncode}: {short_error(p.stderr)}") from None
            if not res.get("ok"):
                raise RuntimeError(short_error(res.get("error", "")))
            return res["ranks"]
        finally:
            Path(out).unlink(missing_ok=True)


class LocalCopies:
    """The state of each size as stock DCP files on local disk (``FileSystemWriter``):
    the bytes the s5cmd and transfer_manager rows copy. Written once per size."""

    def __init__(self, args, runner: Runner):
        self.args, self.runner = args, runner
        self.dirs: dict[int, tuple[Path, dict]] = {}

    def get(self, nbytes: int) -> tuple[Path, dict]:
        if nbytes not in self.dirs:
            src = Path(tempfile.mkdtemp(prefix=f"cloudckpt-bench-src-{size_label(nbytes)}-", dir=self.args.tmp))
            fp = summarize(self.runner.ranks("dcp_local", "save", str(src / "model_and_optim"), nbytes,
                                             self.args.ranks), "save")
            self.dirs[nbytes] = (src, fp)
        return self.dirs[nbytes]

    def drop(self, nbytes: int) -> None:
        src, _ = self.dirs.pop(nbytes, (None, None))
        if src is not None:
            shutil.rmtree(src, ignore_errors=True)

    def close(self) -> None:
        for n in list(self.dirs):
            self.drop(n)
