"""The CLI on a folder holding steps another tool wrote (OLMo-core's marker, made here
from our own saves; the real OLMo-core is in tests/integrations/test_olmo_core.py):
list's FORMAT, verify without a manifest, adopt (dry run, --yes, again), inspect,
download of an adopted step, prune --include-foreign."""

from __future__ import annotations

import json

from cloudckpt.checkpoint import layout
from cloudckpt.checkpoint.layout import ADOPTED_MANIFEST
from cloudckpt.storage import open_store
from cloudckpt.storage import url as urls

from .helpers import cli, new_root, save_steps

OLMO_MARKER = json.dumps({"ephemeral": False, "version": "3.0.0"}).encode()


def test_a_folder_with_olmo_core_steps_through_the_cli(stores, tmp_path_factory, tmp_path):
    # GCS here (conditional create by generation); the same commands run on S3 and local
    # folders against real OLMo-core steps in tests/integrations/test_olmo_core.py
    folder = new_root("gcs", stores, tmp_path_factory) + "/run"
    save_steps(folder, [(10, False), (20, False), (30, False)], str(tmp_path / "w"))
    for s in (20, 30):
        open_store(folder).put_bytes(layout.marker_url(layout.step_dir(folder, s)), OLMO_MARKER)
    step30 = layout.step_dir(folder, 30)

    r = cli("list", folder)
    assert r.code == 0, r.err
    rows = {int(ln.split()[0]): ln.split()[2] for ln in r.out.splitlines()[1:4]}
    assert rows == {10: "cloudckpt", 20: "olmo-core", 30: "olmo-core"}
    assert "2 step(s) written by another tool have no manifest" in r.out

    r = cli("verify", step30, "--json")
    assert r.code == 1 and r.json()["manifest"] is False and r.json()["bad"] == [] and "no manifest" in r.err
    r = cli("inspect", step30)
    assert r.code == 0 and "by olmo-core 3.0.0; no manifest (unverified" in r.out, r.out + r.err

    r = cli("adopt", step30, "--json")  # dry run
    assert r.code == 0 and r.json()["dry_run"] and not r.json()["written"], r.err
    assert not open_store(step30).exists(urls.join(step30, ADOPTED_MANIFEST))
    r = cli("adopt", step30, "--yes", "--json")
    assert r.code == 0 and r.json()["written"] and r.json()["object_count"] == 6, r.err
    assert cli("adopt", step30, "--yes").out.endswith("already has a manifest (adopted): nothing to do\n")
    assert cli("verify", step30).code == 0
    assert open_store(step30).get_bytes(layout.marker_url(step30)) == OLMO_MARKER  # OLMo-core's marker untouched

    dest = str(tmp_path / "local")
    assert cli("download", step30, dest).code == 0
    assert cli("list", dest, "--json").lines()[0]["format"] == "olmo-core+manifest"

    r = cli("prune", folder, "--keep-last", "1", "--json")
    assert r.json()["prune"] == [] and r.json()["foreign"] == {"steps": [20, 30], "counted": False}
    r = cli("prune", folder, "--keep-last", "1", "--include-foreign", "--yes", "--json")
    assert r.code == 0 and r.json()["deleted"] == [10, 20], r.err
    assert [s["step"] for s in cli("list", folder, "--json").lines()] == [30]
