"""Module-level functions run on spawned ranks (they must be importable)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from cloudckpt import Checkpointer
from cloudckpt.checkpoint import discovery
from cloudckpt.errors import CloudCkptError


def full_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.w": torch.randn(64, 24, generator=g),
        "model.b": torch.randn(24, generator=g),
        "optim.w_exp_avg": torch.randn(64, 24, generator=g),
        "optim.w_exp_avg_sq": torch.rand(64, 24, generator=g),
    }


def sharded_state(world_size: int, seed: int = 0, zero: bool = False) -> dict:
    """A DCP state dict with Shard(0) DTensors, a replicated tensor and optimizer state."""
    mesh = init_device_mesh("cpu", (world_size,))
    t = full_tensors(seed)
    if zero:
        t = {k: torch.zeros_like(v) for k, v in t.items()}

    def d(name, placement):
        return distribute_tensor(t[name].clone(), mesh, [placement])

    return {
        "model": {"w": d("model.w", Shard(0)), "b": d("model.b", Replicate())},
        "optim": {"state": {"w": {"exp_avg": d("optim.w_exp_avg", Shard(0)),
                                  "exp_avg_sq": d("optim.w_exp_avg_sq", Shard(0))}},
                  "step": 0 if zero else 7},
    }


def gathered(sd: dict) -> dict[str, torch.Tensor]:
    return {
        "model.w": sd["model"]["w"].full_tensor(),
        "model.b": sd["model"]["b"].full_tensor(),
        "optim.w_exp_avg": sd["optim"]["state"]["w"]["exp_avg"].full_tensor(),
        "optim.w_exp_avg_sq": sd["optim"]["state"]["w"]["exp_avg_sq"].full_tensor(),
    }


def save_sharded(rank, world_size, dir, work_dir, seed=0, ephemeral=False):
    ck = Checkpointer(work_dir=work_dir)
    marker = ck.save(dir, sharded_state(world_size, seed), {"rank": rank, "step": 7, "lr": 0.1}, ephemeral=ephemeral)
    ck.close()
    full = discovery.read_marker(dir)  # save returns the header: the ranks' files are in their parts
    assert (full.object_count, full.total_bytes) == (marker.object_count, marker.total_bytes)
    return {"objects": [o.path for o in full.objects], "world_size": marker.world_size}


def load_sharded(rank, world_size, dir, work_dir, pre_download=False):
    ck = Checkpointer(work_dir=work_dir, pre_download=pre_download)
    sd = sharded_state(world_size, zero=True)
    ts = ck.load(dir, sd)
    info = ck.last_load_info
    ck.close()
    return {"tensors": gathered(sd), "step": sd["optim"]["step"], "train_state": ts,
            "direct_items": info.direct_items}


def save_with_failing_rank(rank, world_size, dir, work_dir, bad_rank):
    """``bad_rank``'s uploads of shard files fail mid-stream; report what each rank raised."""
    from cloudckpt.errors import AccessDenied
    from cloudckpt.storage import open_store

    if rank == bad_rank:
        store = open_store(dir)
        real = store.upload_file  # shard files are uploaded by name (their CRC came from the writer)

        def broken(local_path, url, progress=None, **kw):
            if url.endswith(".distcp"):
                with open(local_path, "rb") as f:
                    sent = f.read(1024)  # some bytes went out
                if progress:
                    progress(len(sent))
                raise AccessDenied("injected failure mid-upload", url=url)
            return real(local_path, url, progress=progress, **kw)

        store.upload_file = broken
    ck = Checkpointer(work_dir=work_dir)
    try:
        ck.save(dir, sharded_state(world_size), {"rank": rank})
    except CloudCkptError as e:
        return {"error": type(e).__name__, "message": str(e)}
    finally:
        ck.close()
    return {"error": None}


def save_plain(rank, world_size, dir, work_dir, value):
    """A plain (non-sharded) save; returns the error type name or None."""
    ck = Checkpointer(work_dir=work_dir)
    try:
        ck.save(dir, {"model": {"x": torch.full((1024, 256), float(value))}}, {"who": value})
        return None
    except CloudCkptError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        ck.close()


def async_roundtrip(rank, world_size, dir, work_dir):
    """save_async while the training group runs its own collectives, then load back."""
    import torch.distributed as tdist

    ck = Checkpointer(work_dir=work_dir)
    sd = sharded_state(world_size)
    fut = ck.save_async(dir, sd, {"rank": rank})
    # training goes on: mutate the live state and run collectives on the default group
    with torch.no_grad():
        sd["model"]["w"].to_local().add_(100.0)
    for _ in range(20):
        t = torch.ones(8)
        tdist.all_reduce(t)
        assert t[0].item() == world_size
    marker = fut.result(timeout=120)
    ck.wait()
    out = sharded_state(world_size, zero=True)
    ts = ck.load(dir, out)
    ck.close()
    return {"tensors": gathered(out), "train_state": ts, "objects": marker.object_count}


def async_failure(rank, world_size, dir, work_dir):
    """An async save whose uploads fail on rank 1: the error surfaces on the next save and on close."""
    from cloudckpt.errors import AccessDenied, SaveFailed
    from cloudckpt.storage import open_store

    store = open_store(dir)
    real = store.upload_file, store.upload_fileobj
    if rank == 1:
        def broken(_, url, **kw):
            raise AccessDenied("injected async failure", url=url)

        store.upload_file = store.upload_fileobj = broken
    ck = Checkpointer(work_dir=work_dir)
    fut = ck.save_async(dir, sharded_state(world_size), {"rank": rank})
    exc = fut.exception(timeout=120)
    surfaced_on_next = None
    try:
        ck.save_async(dir, sharded_state(world_size), {"rank": rank})
    except SaveFailed as e:
        surfaced_on_next = str(e)
    store.upload_file, store.upload_fileobj = real
    # the failure was reported once; a later save succeeds (the step was never committed)
    ck.save_async(dir, sharded_state(world_size), {"rank": rank}).result(timeout=120)
    ck.close()
    return {"future_error": type(exc).__name__, "message": str(exc), "surfaced_on_next": surfaced_on_next}


def load_counting_metadata_gets(rank, world_size, dir, work_dir):
    """Load, counting this rank's GETs of DCP's ``.metadata`` (any store)."""
    from cloudckpt.storage import open_store

    store_cls = type(open_store(dir))
    real = store_cls.get_bytes
    gets = []

    def get_bytes(self, url, **kw):
        gets.append(url)
        return real(self, url, **kw)

    store_cls.get_bytes = get_bytes
    try:
        out = load_sharded(rank, world_size, dir, work_dir)
    finally:
        store_cls.get_bytes = real
    out["metadata_gets"] = sum(u.endswith("/model_and_optim/.metadata") for u in gets)
    out["index_header_gets"] = sum(u.endswith("/index/header.json") for u in gets)
    out["index_parts"] = sorted(u.rsplit("/", 1)[1] for u in gets if "/index/rank" in u)
    return out


def load_waiting_for_connect(rank, world_size, dir, work_dir):
    """Load; on ranks other than 0, hold back from rank 0's marker broadcast until the
    store's client has been built (by the checkpointer's warm-up thread). Reports
    whether it was built in time and on which thread."""
    import threading

    from cloudckpt import dist
    from cloudckpt.storage import open_store

    store_cls = type(open_store(dir))
    real_connect, real_on_coord = store_cls.connect, dist.Coordinator.on_coordinator
    built = threading.Event()
    seen = {}

    def connect(self):
        real_connect(self)
        seen["thread"] = threading.current_thread().name
        built.set()

    def on_coordinator(self, step, fn):
        if step == "read marker" and not self.is_coordinator:
            seen["before_marker"] = built.wait(30)
        return real_on_coord(self, step, fn)

    store_cls.connect, dist.Coordinator.on_coordinator = connect, on_coordinator
    try:
        out = load_sharded(rank, world_size, dir, work_dir)
    finally:
        store_cls.connect, dist.Coordinator.on_coordinator = real_connect, real_on_coord
    out.update(seen)
    return out
