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
        losses: dict[int, str] = {}  # run 1's loss at each step, as printed
        for line in p.stdout:
            if "loss" in line and line.startswith("step") or "RESUMED" in line:
                print("   " + line.rstrip(), flush=True)
            m = re.match(r"step\s+(\d+) loss ([\d.]+)", line)
            if m:
                losses[int(m.group(1))] = m.group(2)
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
        again = {int(n): loss for n, loss in re.findall(r"^step\s+(\d+) loss ([\d.]+)", text, re.M)}
        redone = sorted(set(again) & set(losses))  # steps run 1 took after its last checkpoint
        if any(again[n] != losses[n] for n in redone):
            print("!! the resumed run's losses differ from run 1's at the same steps:")
            for n in redone:
                print(f"   step {n}: run 1 {losses[n]}, run 2 {again[n]}")
            return 1
        if redone:
            print(f"== resumed at step {redone[0]}: steps {redone[0]}-{redone[-1]} repeat run 1's losses exactly "
                  f"({', '.join(again[n] for n in redone)})", flush=True)
        else:  # the preemption's own checkpoint was the newest: nothing to repeat
            print(f"== resumed after step {max(losses)}, the last step run 1 took", flush=True)

        print("== cloudckpt list s3://demo/run-1", flush=True)
        r = subprocess.run([sys.executable, "-m", "cloudckpt", "list", "s3://demo/run-1", "--all"], env=env, cwd=ROOT)
        if r.returncode != 0:
            return 1
    print(f"== demo finished in {time.time() - t0:.0f}s; SeaweedFS stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
