"""OLMo-core's real Trainer checkpointing through cloudckpt, for
tests/integrations/test_olmo_core_trainer.py. Runs with the python of .venv-olmo and
cloudckpt from the source tree (PYTHONPATH); the trainer set-up is olmo_tool.py's
(a 1M-parameter OLMo2 on random tokens, CPU, gloo), with
``TrainerConfig(checkpointer=CloudCheckpointerConfig())``.

    train FOLDER --work W --out DIR --steps 6 --interval 2 [--slow-after K] [--async]
        DIR/saved-{step}.pt: model, optimizer and trainer state when each save was
        committed (post_checkpoint_saved; synchronous saves only); DIR/resumed.pt the same
        right after the Trainer loaded a checkpoint; DIR/final.pt at the end.
        Prints "COMMITTED {step}", "RESUMED {step}", "DONE {step}".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def main() -> None:
    import numpy as np
    import torch
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig, prepare_training_environment, teardown_training_environment
    from olmo_core.train.callbacks import Callback, CheckpointerCallback
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    from cloudckpt.checkpoint.committed import CommittedStep
    from cloudckpt.integrations.olmo_core import CloudCheckpointer, CloudCheckpointerConfig

    read_metadata = CommittedStep.metadata_bytes

    def metadata_bytes(self):  # the test asserts a resume never reads DCP's whole .metadata
        print("DCP METADATA READ", self.step.metadata_url, flush=True)
        return read_metadata(self)

    CommittedStep.metadata_bytes = metadata_bytes

    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["train"])
    ap.add_argument("folder")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--slow-after", type=int)
    ap.add_argument("--async", dest="async_", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    prepare_training_environment(seed=0, backend="gloo")
    tok = TokenizerConfig(vocab_size=128, eos_token_id=0, pad_token_id=1)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    tokens = work / "tokens.npy"
    if not tokens.exists():
        np.random.default_rng(0).integers(2, 128, size=64 * 200, dtype=np.uint16).tofile(tokens)
    ds = NumpyFSLDatasetConfig(paths=[str(tokens)], sequence_length=32, tokenizer=tok,
                               work_dir=str(work / "ds")).build()
    model = TransformerConfig.olmo2_1M(vocab_size=128).build(init_device="cpu")
    tm = TransformerTrainModuleConfig(rank_microbatch_size=4 * 32, max_sequence_length=32,
                                      optim=AdamWConfig(lr=1e-3)).build(model, device=torch.device("cpu"))
    dl = NumpyDataLoaderConfig(global_batch_size=4 * 32, seed=0, num_workers=0).build(ds)

    def dump(name: str) -> int:
        ts = trainer.state_dict()
        state = {"module": tm.state_dict_to_save(), "global_step": ts["global_step"], "data_loader": ts["data_loader"],
                 "tokens_seen": ts["global_train_tokens_seen"]}
        torch.save(state, out / name)
        return ts["global_step"]

    @dataclass
    class Probe(Callback):
        def post_checkpoint_saved(self, path):
            if not a.async_:
                dump(f"saved-{self.trainer.global_step}.pt")
            print("COMMITTED", Path(str(path)).name[len("step"):], flush=True)

        def post_checkpoint_loaded(self, path):
            print("RESUMED", dump("resumed.pt"), flush=True)

        def post_train_batch(self):
            if a.slow_after is not None and self.trainer.global_step >= a.slow_after:
                time.sleep(1.0)  # room for the test's SIGKILL while training goes on

    trainer = TrainerConfig(
        save_folder=a.folder, work_dir=str(work / "trainer"), max_duration=Duration.steps(a.steps), device="cpu",
        metrics_collect_interval=1, cancel_check_interval=1, checkpointer=CloudCheckpointerConfig(),
    ).with_callback("checkpointer", CheckpointerCallback(
        save_interval=a.interval, ephemeral_save_interval=None, save_async=a.async_, max_checkpoints=None,
    )).with_callback("probe", Probe()).build(tm, dl)
    assert isinstance(trainer.checkpointer, CloudCheckpointer), type(trainer.checkpointer)
    trainer.fit()
    print("DONE", dump("final.pt"), flush=True)
    teardown_training_environment()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
