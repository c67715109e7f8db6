"""The README demo, end to end on this machine (loopback only):

1. start SeaweedFS (S3) on 127.0.0.1 and create the bucket ``demo``;
2. train with ``torchrun --nproc_per_node 2 examples/train.py`` checkpointing to
   ``s3://demo/run-1``, and kill the run mid-way (simulated preemption: SIGTERM
   to the job, as a scheduler does);
3. start the same command again: it resumes from the newest committed step in
   the bucket and trains to the end;
4. ``cloudckpt list s3://demo/run-1``; stop the server.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cloudckpt.testing.servers import SeaweedFS, free_port  # noqa: E402

KILL_AT_STEP = 23


def torchrun(env: dict, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(ROOT, "examples", "train.py"),
           "--config", os.path.join(ROOT, "examples", "demo.yaml"), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT)


def main() -> int:
    t0 = time.time()
    with SeaweedFS() as s3:
        s3.create_bucket("demo")
        env = dict(os.environ, **s3.env(), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        print(f"== SeaweedFS S3 on {s3.endpoint_url}; bucket s3://demo", flush=True)

        print(f"== run 1: training, to be preempted at step {KILL_AT_STEP}", flush=True)
        p = torchrun(env, "--step-delay", "0.05")
        last_loss = None
        for line in p.stdout:
            if "loss" in line and line.startswith("step") or "RESUMED" in line:
                print("   " + line.rstrip(), flush=True)
            m = re.match(r"step\s+(\d+) loss ([\d.]+)", line)
            if m:
                last_loss = float(m.group(2))
                if int(m.group(1)) >= KILL_AT_STEP:
                    print(f"== preempting the job at step {m.group(1)} (SIGTERM to torchrun)", flush=True)
                    os.killpg(p.pid, signal.SIGTERM)
                    break
        rest = p.communicate(timeout=180)[0]
        if p.returncode == 0:
            print(rest)
            print("!! run 1 was expected to be killed")
            return 1

        print("== run 2: the same command again (resumes from the bucket)", flush=True)
        p = torchrun(env)
        out = []
        for line in p.stdout:
            out.append(line)
            if line.startswith(("step", "RESUMED", "DONE")):
                print("   " + line.rstrip(), flush=True)
        p.wait(timeout=300)
        text = "".join(out)
        if p.returncode != 0 or "RESUMED from step" not in text or "DONE" not in text:
            print(text[-4000:])
            print("!! run 2 failed or did not resume")
            return 1
        first = re.search(r"step\s+(\d+) loss ([\d.]+)", text)
        print(f"== resumed: first step after resume {first.group(1)} with loss {first.group(2)} "
              f"(last loss before the kill: {last_loss})", flush=True)

        print("== cloudckpt list s3://demo/run-1", flush=True)
        r = subprocess.run([sys.executable, "-m", "cloudckpt", "list", "s3://demo/run-1", "--all"], env=env, cwd=ROOT)
        if r.returncode != 0:
            return 1
    print(f"== demo finished in {time.time() - t0:.0f}s; SeaweedFS stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
