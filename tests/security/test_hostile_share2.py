"""Share 2 of the hostile tries (test_hostile.py holds the runner, its fixtures and share 0):
a file of its own so that another worker of the suite can run it (--dist loadfile)."""

from __future__ import annotations

import pytest

from .test_hostile import bucket, run_try, sandbox, share, try_id  # noqa: F401 - bucket, sandbox: fixtures

SHARE = share(2)


@pytest.mark.parametrize("t", SHARE, ids=[try_id(t) for t in SHARE])
def test_hostile_try(t, sandbox, tmp_path, request):  # noqa: F811 - the fixture imported above
    run_try(t, sandbox, tmp_path, request)
