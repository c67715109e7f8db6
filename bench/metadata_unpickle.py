"""What the exact-allowlist unpickler of DCP ``.metadata`` costs against plain
``pickle.loads`` (the C unpickler stock DCP uses), on a synthetic ``.metadata`` the
size of a large model's: 600 layers x (weight, exp_avg, exp_avg_sq) x 64 ranks'
chunks (115,200 items, ~16 MB). Both run in the same process, alternately.

    .venv/bin/python -m bench.metadata_unpickle [--reps 3]
"""

from __future__ import annotations

import argparse
import pickle
import time


def synthetic_metadata(layers: int = 600, ranks: int = 64) -> tuple[bytes, dict]:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    item = 64 * 4096 * 4 + 1000
    sdm, sd, files = {}, {}, {}
    for p in range(layers):
        for k, kind in enumerate(("model", "optim.exp_avg", "optim.exp_avg_sq")):
            fqn = f"{kind}.layers.{p}.weight"
            chunks = [ChunkStorageMetadata(offsets=torch.Size([r * 64, 0]), sizes=torch.Size([64, 4096]))
                      for r in range(ranks)]
            sdm[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32),
                                             size=torch.Size([64 * ranks, 4096]), chunks=chunks)
            for r, c in enumerate(chunks):
                sd[MetadataIndex(fqn, c.offsets, r)] = _StorageInfo(f"__{r}_0.distcp", (p * 3 + k) * item, item)
    for r in range(ranks):
        files[f"__{r}_0.distcp"] = layers * 3 * item
    return pickle.dumps(Metadata(state_dict_metadata=sdm, storage_data=sd), protocol=4), files


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=600, help="fewer for a quick run")
    args = ap.parse_args()
    from cloudckpt.untrusted import loads_metadata

    data, files = synthetic_metadata(args.layers)
    plain, ours = [], []
    for _ in range(args.reps):
        t = time.perf_counter()
        pickle.loads(data)
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        loads_metadata(data, url="synthetic", files=files)
        ours.append(time.perf_counter() - t)
    p, o = sorted(plain)[len(plain) // 2], sorted(ours)[len(ours) // 2]
    print(f".metadata {len(data) / 1e6:.1f} MB: pickle.loads {p:.2f} s, cloudckpt loads_metadata {o:.2f} s "
          f"(unpickle + validation), ratio {o / p:.1f} (median of {args.reps})")


if __name__ == "__main__":
    main()
