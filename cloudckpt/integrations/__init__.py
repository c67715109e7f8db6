"""Integrations with trainers. Each submodule imports its trainer lazily, so
importing ``cloudckpt`` never needs them:

- :mod:`cloudckpt.integrations.lightning`: a Lightning ``CheckpointIO`` (sync and
  async with finalization), so ``Trainer(default_root_dir="s3://…")`` and
  ``ModelCheckpoint(dirpath="gs://…")`` checkpoint through cloudckpt.
"""
