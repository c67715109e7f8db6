"""One sandbox zygote per test process for every module of tests/security: a zygote
imports torch, Lightning, transformers and every module of cloudckpt before its first
fork (seconds), and each try still runs in a fork of it (a runner or a fork of its
own: sandbox.py), so sharing the zygote changes nothing a try sees. It has
SeaweedFS's environment (the S3 tries need it) and is warmed up by
``test_hostile.warm_up`` (every hostile_*.py imported, one honest save, load and
inspect); its cache folder (``tries.cached``, ``tries.honest_step``) is shared too."""

from __future__ import annotations

import pytest

from .sandbox import Sandbox


@pytest.fixture(scope="session")
def hostile_sandbox(seaweed):
    with Sandbox(env=seaweed.env(), warm_up="tests.security.test_hostile:warm_up") as sb:
        yield sb
