"""Drives the real megatron-core (0.19.2, .venv-megatron) for tests/integrations/test_megatron.py.

Runs with the python of .venv-megatron (scripts/setup_megatron_venv.sh) and cloudckpt
from the source tree (PYTHONPATH). Every command starts ``--world`` ranks itself
(spawned processes, gloo on 127.0.0.1, CPU) and exits non-zero if any rank failed.

    save URL --world W [--stock] [--extra N] [--again] [--replicas]   the sharded state
        dict below (a dim-0 split ShardedTensor, a replicated one, one ShardedObject per
        rank, a factory, common state; --extra: N more tensors) saved through
        cloudckpt.integrations.megatron.save (--stock: Megatron's own
        dist_checkpointing.save into the local folder URL); --again: saved once more, by
        the same Checkpointer, as the next iteration; --replicas: with
        keep_only_main_replica=False; --gathered: planned from every rank's plan gathered
        on rank 0 (DCP's global planning, ``RankWriter.owners_first_save = False``).
        Prints what rank 1 received in broadcasts and rank 0 in DCP's plan gathers, per
        save, and whether the save kept its structure
    load URL [DEST] --world W [--stock] [--extra N]   the same structure at world W loaded back
        (--stock: Megatron's own dist_checkpointing.load, its default strategy) and
        compared bit for bit with what any world size saved; prints "LOADED OK"; DEST:
        then saved there by the same Checkpointer (what rank 0 gathered is printed)
    import SRC URL                      import_folder(SRC, URL)
    fail BUCKET MISSING --world W --dead-port P   saves and loads through a bucket that
        does not exist, a store that does not answer (port P), on one rank only, a step that
        does not exist, an unknown scheme, a folder without a step number: each rank
        prints each case's error type
    gpt-save URL --world W [--pp P] --out F   a tiny GPTModel (local layer spec) at
        pipeline parallel P, tensor parallel W / P: its logits on a fixed batch to F, each
        rank's local weights to F.rank{R}, its weights saved to URL
    gpt-load URL [URL2] --world W --out F   the same model at tensor parallel W loaded
        from URL: its logits to F (its weights to F.rank0); then from URL2 (F.2, F.2.rank0)
    strict URL --world W               Megatron's strict handling, metadata readers and error
        types on a step saved to URL (cmd_strict's docstring); prints STRICT {R} {json}
    train --world W --train ARGS...     train_gpt.py's main on each rank with ARGS (its own
        process group; its CPU stand-ins undone afterwards)
    bridge URL --world W --steps N --out F   Megatron-Bridge's call sequence on cloudckpt's
        manager (tests/integrations/megatron_units/bridge_tool.py, on PYTHONPATH)

    serve --world W                    a pool of W ranks that import Megatron once and run
        the commands above one after another (tests/integrations/megatron_pool.py is its
        client): each line of stdin is a JSON ``{"argv": [...], "env": {...}}`` (a command
        line as above, without --port); each command gets a new gloo process group of its
        own ``--world`` (ranks at and above it sit it out), Megatron's parallel state
        and every process group are destroyed after it, and one JSON line answers on
        stdout: ``{"ok": bool, "ranks": {R: {"status", "out"}}}`` (``out``: what the rank
        printed, with the traceback of its error). A rank that dies ends the pool
        (exit 3). The ranks' own stdout goes to stderr: stdout carries answers only.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys

import torch
import torch.distributed as dist

ROWS, COLS = 8, 4


def expected() -> dict:
    a = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 7
    return {"a": a, "b": torch.linspace(-1, 1, 5, dtype=torch.float64), "f": a.flip(0) * 3}


def sharded_sd(world: int, rank: int, *, fill: bool, extra: int = 0) -> dict:
    """The state dict at world size ``world`` (``fill``: the saved values; else zeros),
    with ``extra`` more tensors (``extra{i}``: ``2 * SAVED_WORLD`` elements ``i``; a larger
    global Metadata)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    e = expected()
    rows = ROWS // world
    part = slice(rank * rows, (rank + 1) * rows)

    def val(t):
        return t.clone() if fill else torch.zeros_like(t)

    def build(key, data, replica_id, flattened_range):  # a factory: the tensor saved as two column halves
        return {"h0": ShardedTensor.from_rank_offsets(f"{key}.h0", data[:, :2].clone(), (0, rank, world),
                                                      replica_id=replica_id),
                "h1": ShardedTensor.from_rank_offsets(f"{key}.h1", data[:, 2:].clone(), (0, rank, world),
                                                      replica_id=replica_id)}

    def merge(sub):
        return torch.cat([sub["h0"], sub["h1"]], dim=1)

    sd = {
        "a": ShardedTensor.from_rank_offsets("a", val(e["a"][part]), (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", val(e["b"]), replica_id=rank),
        "f": ShardedTensorFactory("f", val(e["f"][part]), build, merge),
        "iteration": 7,
    }
    # ShardedObjects are not resharded by DCP: at any world size a rank asks for the objects
    # of saved rank i with i % world == rank (SAVED_WORLD of them in all)
    saved_world = int(os.environ.get("SAVED_WORLD", world))
    sd["objs"] = [ShardedObject("obj", {"saved_by": i, "words": ["x"] * i} if fill else None, (saved_world,), (i,),
                                replica_id=0) for i in range(saved_world) if i % world == rank]
    for i in range(extra):  # each of 2 * saved_world elements, split over the ranks
        sd[f"extra{i}"] = ShardedTensor.from_rank_offsets(
            f"extra{i}", torch.full((2 * saved_world // world,), float(i) if fill else 0.0), (0, rank, world))
    return sd


def check_loaded(state: dict, world: int, rank: int) -> None:
    e = expected()
    rows = ROWS // world
    part = slice(rank * rows, (rank + 1) * rows)
    assert torch.equal(state["a"], e["a"][part]), ("a", state["a"])
    assert torch.equal(state["b"], e["b"]) and state["b"].dtype == torch.float64, ("b", state["b"])
    assert torch.equal(state["f"], e["f"][part]), ("f", state["f"])
    assert state["iteration"] == 7, state["iteration"]
    saved_world = int(os.environ.get("SAVED_WORLD", world))
    want = [{"saved_by": i, "words": ["x"] * i} for i in range(saved_world) if i % world == rank]
    assert state.get("objs", []) == want, (state.get("objs"), want)  # Megatron drops an empty list
    extras = sorted(k for k in state if k.startswith("extra"))
    assert all(torch.equal(state[k], torch.full((2 * saved_world // world,), float(k[5:]))) for k in extras), extras


class Collectives:
    """While entered: the largest pickled broadcast a rank received from another
    (``received``) and the largest plan the gathering rank received in DCP's plan step,
    ``reduce_scatter`` (``gathered``), in bytes."""

    def __init__(self):
        self.received = self.gathered = 0
        self.real = dist.broadcast_object_list, dist.gather_object

    def _broadcast(self, object_list, src=0, group=None, device=None, **kw):
        out = self.real[0](object_list, src=src, group=group, device=device, **kw)
        if dist.get_rank() != src:
            self.received = max(self.received, len(pickle.dumps(object_list)))
        return out

    def _gather(self, *args, **kw):
        out = self.real[1](*args, **kw)
        got = kw.get("object_gather_list", args[1] if len(args) > 1 else None)
        f, frames = sys._getframe(1), []
        while f is not None and len(frames) < 12:
            frames.append(f.f_code.co_name)
            f = f.f_back
        if got and "reduce_scatter" in frames:
            self.gathered = max(self.gathered, max(len(pickle.dumps(o)) for o in got))
        return out

    def __enter__(self):
        dist.broadcast_object_list, dist.gather_object = self._broadcast, self._gather
        return self

    def __exit__(self, *exc):
        dist.broadcast_object_list, dist.gather_object = self.real


def cmd_save(a, rank, world):
    import resource
    import time

    from megatron.core import dist_checkpointing

    def state() -> dict:
        return sharded_sd(world, rank, fill=True, extra=a.extra)

    if a.stock:  # Megatron's own save calls torch.cuda.synchronize() and current_device(): CPU stand-ins
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: torch.device("cpu")
        os.makedirs(a.url, exist_ok=True)
        dist_checkpointing.save(state(), a.url)
        return
    from cloudckpt import Checkpointer
    from cloudckpt.integrations import megatron as cm

    spy = Collectives()
    urls = [a.url] + ([f"{a.url.rsplit('_', 1)[0]}_{cm.step_number(a.url) + 1:07d}"] if a.again else [])
    seen = []
    with spy, Checkpointer(work_dir=a.work) as ck:
        ck._writer.owners_first_save = not a.gathered
        for url in urls:
            spy.received = spy.gathered = 0
            sd = state()
            rss, cpu, wall = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.process_time(), time.monotonic()
            cm.save(sd, url, checkpointer=ck, keep_only_main_replica=not a.replicas)
            cost = (time.process_time() - cpu, time.monotonic() - wall,
                    (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024)
            seen.append((spy.received, spy.gathered, type(ck._writer._loaded).__name__, cost))
    for n, (bcast, plan, kept, (cpu, wall, grown)) in enumerate(seen):
        if rank == 1:
            print(f"SAVE {n} RANK 1 LARGEST BROADCAST {bcast}", flush=True)
        if rank == 0:
            print(f"SAVE {n} RANK 0 LARGEST PLAN GATHERED {plan} KEPT {kept}", flush=True)
            print(f"SAVE {n} RANK 0 COST cpu {cpu:.2f} s wall {wall:.2f} s peak RSS growth {grown:.1f} MiB",
                  flush=True)


def cmd_load(a, rank, world):
    from megatron.core import dist_checkpointing

    sd = sharded_sd(world, rank, fill=False, extra=a.extra)
    if a.stock:
        state = dist_checkpointing.load(sd, a.url)
    else:
        from cloudckpt import Checkpointer
        from cloudckpt.integrations import megatron as cm

        with Checkpointer(work_dir=a.work) as ck:
            state = cm.load(sd, a.url, checkpointer=ck)
            if a.dest is not None:  # the job's first save after the load, by the same Checkpointer
                with Collectives() as spy:
                    cm.save(sharded_sd(world, rank, fill=True, extra=a.extra), a.dest, checkpointer=ck)
                if rank == 0:
                    print(f"SAVE AFTER LOAD RANK 0 LARGEST PLAN GATHERED {spy.gathered} "
                          f"KEPT {type(ck._writer._loaded).__name__}", flush=True)
    check_loaded(state, world, rank)
    if rank == 0:
        print("LOADED OK", flush=True)


def gpt(tp: int, pp: int = 1):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Megatron's attention takes a scratch buffer on torch.cuda.current_device(): on the CPU here
    torch.cuda.current_device = lambda: torch.device("cpu")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             create_gloo_process_groups=False)
    # no CUDA RNG to track: Megatron's inference tracker forks nothing
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(1234 + tp + 10 * pp)  # a model of another size starts from other weights than the one saved
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               pipeline_dtype=torch.float32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=8, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    model.eval()
    return model


def logits(model, pp: int = 1) -> torch.Tensor | None:
    """The logits of a fixed batch, gathered over tensor parallel ranks; with ``pp`` 2 the
    first stage sends its hidden states to the second (which alone returns the logits)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (2, 8), generator=g)
    pos = torch.arange(8).unsqueeze(0).expand(2, 8)
    mask = torch.tril(torch.ones(1, 1, 8, 8)) < 0.5
    with torch.no_grad():
        if pp > 1 and not parallel_state.is_pipeline_first_stage():
            hidden = torch.empty(8, 2, 32)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, pos, mask)
        if pp > 1 and not parallel_state.is_pipeline_last_stage():
            dist.send(out, dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
    return gather_from_tensor_model_parallel_region(out)


def cmd_gpt_save(a, rank, world):
    """Save the model at pipeline parallel ``--pp`` (tensor parallel world / pp); the last
    stage's rank 0 writes the logits, every rank its weights (``{out}.rank{R}``)."""
    from megatron.core import parallel_state

    from cloudckpt.integrations import megatron as cm

    model = gpt(world // a.pp, a.pp)
    out = logits(model, a.pp)
    cm.save(model.sharded_state_dict(), a.url, work_dir=a.work)
    if out is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save(out, a.out)
    torch.save(model.state_dict(), f"{a.out}.rank{rank}")


def cmd_gpt_load(a, rank, world):
    """Load URL (then DEST, when given, into the same model): the logits after each load
    to F (F.2 for DEST), rank 0's weights to F.rank0 (F.2.rank0)."""
    from cloudckpt.integrations import megatron as cm

    model = gpt(world)
    for url, out_file in ((a.url, a.out), (a.dest, f"{a.out}.2")):
        if url is None:
            break
        before = logits(model)
        model.load_state_dict(cm.load(model.sharded_state_dict(), url, work_dir=a.work))
        out = logits(model)
        assert not torch.allclose(before, out), "the model's logits did not change on load"
        if rank == 0:
            torch.save(out, out_file)
            torch.save(model.state_dict(), f"{out_file}.rank{rank}")


def cmd_fail(a, rank, world):
    """Each way a save or load through a bad URL or an unusable store fails, on every rank:
    prints ``CASE {name} rank {R} {error type} {seconds}`` per case (``no error`` if none)."""
    import time

    from cloudckpt.integrations import megatron as cm
    from cloudckpt.storage import StorageOptions

    bucket, missing = a.url, a.dest  # a bucket of the test's store, a bucket that does not exist
    dead = StorageOptions(endpoint_url=f"http://127.0.0.1:{a.dead_port}", max_attempts=1, connect_timeout=1,
                          read_timeout=2, operation_timeout=4)
    cases = {
        "missing-bucket": lambda: cm.save(sharded_sd(world, rank, fill=True), f"{missing}/run/step1", work_dir=a.work),
        "unreachable-store": lambda: cm.save(sharded_sd(world, rank, fill=True), f"{bucket}/run/step2",
                                             work_dir=a.work, storage_options=dead),
        "one-rank-store-unreachable": lambda: cm.save(sharded_sd(world, rank, fill=True), f"{bucket}/run/step3",
                                                      work_dir=a.work, storage_options=dead if rank == 1 else None),
        "no-such-step": lambda: cm.load(sharded_sd(world, rank, fill=False), f"{bucket}/run/step4", work_dir=a.work),
        "unknown-scheme": lambda: cm.save(sharded_sd(world, rank, fill=True), "ftp://host/run/step5", work_dir=a.work),
        "no-step-number": lambda: cm.save(sharded_sd(world, rank, fill=True), f"{bucket}/run/latest", work_dir=a.work),
    }
    from cloudckpt import Checkpointer

    cm._megatron()  # imports and a first request before the clock starts
    Checkpointer.contains_checkpoint(f"{bucket}/warm-up")
    for name, run in cases.items():
        t0 = time.monotonic()
        try:
            run()
            what = "no error"
        except Exception as e:  # noqa: BLE001 - what this command reports
            what = f"{type(e).__name__} {' '.join(str(e).split())[:400]!r}"
        sys.stdout.write(f"CASE {name} rank {rank} {time.monotonic() - t0:.1f}s {what}\n")  # one write a line
        sys.stdout.flush()


def cmd_import(a, rank, world):
    from cloudckpt.integrations import megatron as cm

    print("IMPORTED", cm.import_folder(a.src, a.url, work_dir=a.work), flush=True)


def cmd_strict(a, rank, world):
    """Megatron's ``strict`` handling, its metadata readers and error types on a cloudckpt
    step, as Megatron's own ``TestNonStrictLoad`` checks them: a state dict saved to URL,
    then loaded with 2 unexpected keys and with 2 missing keys under every
    ``StrictHandling``; ``load_sharded_metadata`` and ``load_tensors_metadata`` (first on
    rank 0 alone: they are not collective) and a load of what they return; a step that
    does not exist, a global shape mismatch, ``remove_sharded_tensors``. Each rank prints
    ``STRICT {rank} {json}``: case -> what was seen (the error classes it is an instance
    of and its message, or the keys loaded, returned and logged)."""
    import json
    import logging

    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint import CheckpointException

    from cloudckpt import errors
    from cloudckpt.integrations import megatron as cm

    kinds = {"MissingKeys": errors.MissingKeys, "CollectiveError": errors.CollectiveError,
             "NotACheckpoint": errors.NotACheckpoint, "ConfigError": errors.ConfigError,
             "CheckpointingException": CheckpointingException, "CheckpointException": CheckpointException}

    def base() -> dict:
        return {"TenA": ShardedTensor.from_rank_offsets("TenA", torch.arange(2), replica_id=rank),
                "TenB": ShardedTensor.from_rank_offsets("TenB", torch.arange(3) + 10 * rank, (0, rank, world),
                                                        replica_id=0),
                "ObjA": ShardedObject("ObjA", list(range(4)), (1,), (0,), replica_id=rank),
                "ObjB": ShardedObject("ObjB", {"by": rank}, (1, world), (0, rank), replica_id=0)}

    def with_unexpected() -> dict:
        sd = base()
        sd["TenD"] = ShardedTensor.from_rank_offsets("UnexpectedTenD", torch.arange(3), replica_id=rank)
        sd["ObjD"] = ShardedObject("UnexpectedObjD", None, (1,), (0,), replica_id=rank)
        return sd

    def with_missing() -> dict:
        sd = base()
        del sd["TenA"], sd["ObjB"]
        return sd

    class Logged(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.text = []

        def emit(self, record):
            self.text.append(record.getMessage())

    def outcome(fn) -> dict:
        log = Logged()
        logging.getLogger("megatron.core.dist_checkpointing").addHandler(log)
        try:
            r = fn()
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            return {"raised": sorted(n for n, c in kinds.items() if isinstance(e, c)), "message": str(e)[:3000]}
        finally:
            logging.getLogger("megatron.core.dist_checkpointing").removeHandler(log)
        got = {"logged": " ".join(log.text)[:3000]}
        if isinstance(r, tuple):
            r, got["missing"], got["unexpected"] = r[0], sorted(r[1]), sorted(r[2])
        got["keys"] = sorted(r)
        got["TenB"] = r["TenB"].tolist() if "TenB" in r else None
        return got

    seen: dict = {}
    cm.save(base(), a.url, work_dir=a.work)
    for mode in StrictHandling:
        for case, sd in (("unexpected", with_unexpected), ("missing", with_missing)):
            seen[f"{case} {mode.name}"] = outcome(lambda sd=sd, mode=mode: cm.load(sd(), a.url, strict=mode,
                                                                                   work_dir=a.work))
    if rank == 0:  # one process alone: no other rank takes part
        md = cm.load_sharded_metadata(a.url, work_dir=a.work)
        seen["sharded metadata"] = {"keys": sorted(md), "base keys": sorted({v.key for v in md.values()})}
        tm = cm.load_tensors_metadata(a.url, work_dir=a.work)
        seen["tensors metadata"] = {k: [list(v.global_shape), str(v.dtype)] for k, v in sorted(tm.items())}
    loaded = cm.load(cm.load_sharded_metadata(a.url, work_dir=a.work), a.url, validate_access_integrity=False,
                     work_dir=a.work)
    seen["load of the sharded metadata"] = {
        "ObjA": loaded["ObjA/shard_0_1"], "ObjB": [loaded[f"ObjB/shard_0.{i}_1.{world}"] for i in range(world)],
        "TenA": loaded["TenA"].tolist(), "TenB": loaded["TenB"].tolist()}
    seen["no such step"] = outcome(lambda: cm.load(base(), a.url + "9", work_dir=a.work))
    seen["global shape mismatch"] = outcome(lambda: cm.load(
        {"TenB": ShardedTensor.from_rank_offsets("TenB", torch.zeros(4), (0, rank, world), replica_id=0)}, a.url,
        work_dir=a.work))
    padded = a.url[:-1] + str(int(a.url[-1]) + 1)  # the next iteration: a tensor of 4 * world elements
    cm.save({"Pad": ShardedTensor.from_rank_offsets("Pad", torch.arange(4) + 4 * rank, (0, rank, world))}, padded,
            work_dir=a.work)
    for name, n in (("smaller", 3), ("larger", 5)):  # 3 * world and 5 * world elements asked for
        sd = {"Pad": ShardedTensor.from_rank_offsets("Pad", torch.full((n,), -1), (0, rank, world),
                                                     allow_shape_mismatch=True)}
        seen[f"allow_shape_mismatch {name}"] = cm.load(sd, padded, work_dir=a.work)["Pad"].tolist()
    seen["remove_sharded_tensors"] = outcome(lambda: cm.CloudLoadStrategy(work_dir=a.work).remove_sharded_tensors(
        a.url, "Ten"))
    print(f"STRICT {rank} {json.dumps(seen)}", flush=True)


def cmd_train(a, rank, world):
    """train_gpt.py's ``main`` on this rank (it starts its own process group from RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as under torchrun), with ``a.train`` as its
    command line; the CPU stand-ins it installs are undone afterwards."""
    import train_gpt  # tests/integrations/megatron, this file's folder
    from megatron.core.tensor_parallel import random as mrandom

    patched = [(torch, n) for n in ("tensor", "zeros")] + \
        [(torch.cuda, n) for n in ("current_device", "current_stream", "get_rng_state", "manual_seed")] + \
        [(mrandom, n) for n in ("_get_cuda_rng_state", "_set_cuda_rng_state")]
    before = [(obj, name, getattr(obj, name)) for obj, name in patched]
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(a.port)}
    argv, sys.argv = sys.argv, ["train_gpt.py", *a.train]
    os.environ.update(env)
    try:
        train_gpt.main()
    finally:
        sys.argv = argv
        for obj, name, value in before:
            setattr(obj, name, value)


def cmd_bridge(a, rank, world):
    import bridge_tool  # tests/integrations/megatron_units, on PYTHONPATH

    bridge_tool.run(a, rank, world)


COMMANDS = {"save": cmd_save, "load": cmd_load, "gpt-save": cmd_gpt_save, "gpt-load": cmd_gpt_load,
            "import": cmd_import, "fail": cmd_fail, "bridge": cmd_bridge, "strict": cmd_strict,
            "train": cmd_train}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=sorted(COMMANDS) + ["serve"])
    ap.add_argument("url", nargs="?")
    ap.add_argument("dest", nargs="?")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dead-port", type=int)
    ap.add_argument("--extra", type=int, default=0)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--stock", action="store_true")
    ap.add_argument("--again", action="store_true")
    ap.add_argument("--replicas", action="store_true")
    ap.add_argument("--gathered", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--work")
    ap.add_argument("--train", nargs=argparse.REMAINDER, default=[])
    return ap


def _run(a, rank: int, world: int) -> None:
    """One command on one rank, in a gloo process group of its own ``world``."""
    if a.cmd == "import":  # one process, no process group
        if rank == 0:
            a.src, a.url = a.url, a.dest
            cmd_import(a, 0, 1)
        return
    if a.cmd != "train":  # train_gpt.py starts its own
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{a.port}")
    try:
        COMMANDS[a.cmd](a, rank, world)  # a rank's error ends the run: start_processes stops the others
    finally:
        if "megatron.core.parallel_state" in sys.modules:
            sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()  # the default group and every other one


def _rank(rank: int, a) -> None:
    _run(a, rank, a.world)


def _pool_rank(rank: int, inbox, answers) -> None:
    """A rank of ``serve``: Megatron imported once, then each command from ``inbox``."""
    import contextlib
    import io
    import traceback

    os.dup2(2, 1)  # what the rank's code writes to fd 1 goes to stderr: the pool's stdout carries answers
    from megatron.core import dist_checkpointing  # noqa: F401 - the import every command shares

    from cloudckpt.integrations import megatron as cm

    cm._megatron()
    answers.put((rank, "ready", ""))
    base_env = dict(os.environ)
    while (job := inbox.get()) is not None:
        argv, env, port = job
        a = _parser().parse_args(argv)
        a.port = port
        if rank >= a.world and not (a.cmd == "import" and rank == 0):
            answers.put((rank, "idle", ""))
            continue
        os.environ.clear()
        os.environ.update(base_env, **env)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                _run(a, rank, a.world)
            answers.put((rank, "ok", out.getvalue()))
        except BaseException:  # noqa: BLE001 - the answer carries it
            answers.put((rank, "error", out.getvalue() + traceback.format_exc()))
    answers.close()
    answers.join_thread()  # every answer sent
    sys.stderr.flush()
    os._exit(0)  # nothing to clean: Megatron's helper processes wind down for seconds otherwise


def serve(world: int) -> int:
    """``serve``: the pool (module docstring). Returns the exit status."""
    import json
    import queue
    import socket
    import time

    import torch.multiprocessing as mp

    parent = os.getppid()
    ctx = mp.get_context("spawn")
    inboxes, answers = [ctx.Queue() for _ in range(world)], ctx.Queue()
    # not daemonic: Megatron's own save starts a process of its own in a rank
    procs = [ctx.Process(target=_pool_rank, args=(r, inboxes[r], answers)) for r in range(world)]
    for p in procs:
        p.start()

    def collect(what: str) -> dict | None:
        """Every rank's answer; None when a rank died. A rank still busy 60 s after
        another failed (waiting in a collective) is answered as "hung"."""
        got: dict = {}
        failed_at = None
        while len(got) < world:
            try:
                r, status, out = answers.get(timeout=2)
                got[r] = {"status": status, "out": out}
                if status == "error" and failed_at is None:
                    failed_at = time.monotonic()
            except queue.Empty:
                if os.getppid() != parent:  # the client is gone: nobody will read the answer
                    sys.stderr.write(f"mcore_tool serve: the client left during {what}\n")
                    return None
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if dead:
                    sys.stderr.write(f"mcore_tool serve: rank(s) {dead} died during {what} (exit codes "
                                     f"{[procs[r].exitcode for r in dead]})\n")
                    return None
                if failed_at is not None and time.monotonic() - failed_at > 60:
                    return got | {r: {"status": "hung", "out": "still running 60 s after another rank failed"}
                                  for r in range(world) if r not in got}
        return got

    def answer(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    def end(status: int) -> int:
        for q in inboxes:
            q.put(None)
        for p in procs:
            p.join(timeout=30 if status == 0 else 0)
            if p.exitcode is None:
                p.kill()
                p.join()
        return status

    if collect("the imports") is None:
        return end(3)
    answer({"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for q in inboxes:
            q.put((job["argv"], job.get("env", {}), port))
        got = collect(" ".join(job["argv"]))
        if got is None:
            return end(3)
        answer({"ok": all(g["status"] in ("ok", "idle") for g in got.values()), "ranks": got})
        if any(g["status"] == "hung" for g in got.values()):
            return end(3)  # a rank is stuck: the client starts a new pool
    return end(0)


def main() -> None:
    a = _parser().parse_args()
    if a.cmd == "serve":
        sys.exit(serve(a.world))
    if a.port is None or a.work is None:
        sys.exit("--port and --work are required")
    if a.cmd == "import":
        _run(a, 0, 1)
        return
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(a,), nprocs=a.world, start_method="spawn")


if __name__ == "__main__":
    main()
