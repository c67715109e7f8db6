"""Static checks of terraform/: the modules that provision checkpoint buckets.

`terraform init` / `validate` need provider downloads, which this machine cannot
do, so the modules are checked by what runs offline:

- every .tf file parses (python-hcl2);
- `terraform fmt -check` passes (when terraform is installed);
- the variable validations and the prefix-safety locals are evaluated by the
  real terraform binary on copies of variables.tf / the locals block (no
  providers needed for that);
- checkov (in its own venv, scripts/checkov_venv.sh) reports no failed check,
  and every check it skips is skipped by an inline `#checkov:skip=ID:reason`;
- structural assertions on what matters for cloudckpt (abort-multipart rules,
  TLS-only bucket policy, prefix-scoped IAM, save_folder outputs) and on
  references (`var.x` / `local.x` / module arguments) that `validate` would
  otherwise catch.

No test talks to the network: terraform runs with CHECKPOINT_DISABLE=1 and an
empty CLI config; checkov runs with --skip-download, no API key, the update
check off, and proxies pointed at a closed loopback port, so any call it still
tried would fail at once instead of leaving the machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

try:
    import hcl2
except ImportError as e:  # a missing test dependency is a broken setup, not a reason to skip
    raise ImportError("python-hcl2 is not installed; it is in the test extra: pip install -e '.[test]'") from e

REPO = Path(__file__).resolve().parents[1]
TF_ROOT = REPO / "terraform"
S3_MODULE = TF_ROOT / "modules" / "s3-checkpoint-bucket"
GCS_MODULE = TF_ROOT / "modules" / "gcs-checkpoint-bucket"
MODULES = {"s3": S3_MODULE, "gcs": GCS_MODULE}
EXAMPLES = {"aws": TF_ROOT / "examples" / "aws", "gcp": TF_ROOT / "examples" / "gcp"}
TF_FILES = sorted(TF_ROOT.rglob("*.tf"))
TERRAFORM = shutil.which("terraform")
needs_terraform = pytest.mark.skipif(
    TERRAFORM is None, reason="terraform is not on PATH; install terraform >= 1.5 to run the fmt and validation checks"
)
CLOSED_LOOPBACK = "http://127.0.0.1:9"  # discard port, nothing listens: a stray request fails immediately


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _unq(v):
    """python-hcl2 >= 7 keeps the quotes of string literals and block labels; older versions do not."""
    if isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] == '"':
        return v[1:-1]
    return v


def _load(path: Path) -> dict:
    with open(path) as f:
        return hcl2.load(f)


def _module_docs(module: Path) -> list[dict]:
    return [_load(p) for p in sorted(module.glob("*.tf"))]


def _labelled(docs: list[dict], kind: str) -> dict[tuple[str, str], dict]:
    """``resource`` / ``data`` blocks as {(type, name): body}."""
    out = {}
    for doc in docs:
        for entry in doc.get(kind, []):
            for typ, named in entry.items():
                for name, body in named.items():
                    out[(_unq(typ), _unq(name))] = body
    return out


def _named(docs: list[dict], kind: str) -> dict[str, dict]:
    """``variable`` / ``output`` / ``module`` blocks as {name: body}."""
    out = {}
    for doc in docs:
        for entry in doc.get(kind, []):
            for name, body in entry.items():
                out[_unq(name)] = body
    return out


def _tf_env(tmp_path: Path) -> dict[str, str]:
    cli_config = tmp_path / "terraformrc"
    cli_config.write_text("")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("TF_")},  # no stray TF_VAR_* / TF_CLI_ARGS*
        "CHECKPOINT_DISABLE": "1",  # no version check call to HashiCorp
        "TF_CLI_CONFIG_FILE": str(cli_config),
        "TF_IN_AUTOMATION": "1",
        "TF_INPUT": "0",
        "TF_DATA_DIR": str(tmp_path / ".terraform"),
    }


def _variables_workspace(tmp_path: Path, module: Path, *, with_locals: bool = False) -> Path:
    """A provider-free copy of a module's variables (and its first locals block,
    which only reads variables): enough for terraform to run the validations."""
    ws = Path(tempfile.mkdtemp(prefix=f"{module.name}-", dir=tmp_path))
    shutil.copy(module / "variables.tf", ws / "variables.tf")
    if with_locals:
        m = re.search(r"(?ms)^locals \{\n.*?^\}\n", (module / "main.tf").read_text())
        assert m, f"no top-level locals block in {module / 'main.tf'}"
        (ws / "locals.tf").write_text(m.group(0))
    return ws


REQUIRED_VARS = {
    "s3": {"bucket_name": "ml-checkpoints"},
    "gcs": {"bucket_name": "ml-checkpoints", "project_id": "my-project", "location": "us-central1"},
}


def _plan(tmp_path: Path, module_key: str, overrides: dict[str, str]) -> subprocess.CompletedProcess:
    ws = _variables_workspace(tmp_path, MODULES[module_key])
    args = [TERRAFORM, "plan", "-no-color", "-input=false", "-lock=false", "-refresh=false"]
    for k, v in {**REQUIRED_VARS[module_key], **overrides}.items():
        args.append(f"-var={k}={v}")
    return subprocess.run(args, cwd=ws, env=_tf_env(tmp_path), capture_output=True, text=True, timeout=120)


def _console(tmp_path: Path, module_key: str, expr: str, overrides: dict[str, str]):
    ws = _variables_workspace(tmp_path, MODULES[module_key], with_locals=True)
    args = [TERRAFORM, "console"]
    for k, v in {**REQUIRED_VARS[module_key], **overrides}.items():
        args.append(f"-var={k}={v}")
    r = subprocess.run(args, cwd=ws, env=_tf_env(tmp_path), input=f"jsonencode({expr})\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(json.loads(r.stdout.strip()))


# ---------------------------------------------------------------------------
# parsing and formatting
# ---------------------------------------------------------------------------


def test_terraform_tree_has_both_modules_and_examples():
    for d in [*MODULES.values(), *EXAMPLES.values()]:
        assert sorted(p.name for p in d.glob("*.tf")), f"{d} has no .tf files"
    for module in MODULES.values():
        assert (module / "README.md").is_file(), f"{module} has no README.md"


@pytest.mark.parametrize("path", TF_FILES, ids=[str(p.relative_to(TF_ROOT)) for p in TF_FILES])
def test_every_tf_file_parses_with_python_hcl2(path: Path):
    doc = _load(path)
    assert {k for k in doc if not k.startswith("__")}, f"{path} parsed to nothing"


@needs_terraform
def test_terraform_fmt_check_passes(tmp_path):
    r = subprocess.run([TERRAFORM, "fmt", "-check", "-recursive", "-diff", "-no-color", str(TF_ROOT)],
                       env=_tf_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (f"terraform fmt -check failed (run `terraform fmt -recursive terraform/`):\n"
                               f"{r.stdout}{r.stderr}")


# ---------------------------------------------------------------------------
# checkov
# ---------------------------------------------------------------------------


def _checkov_executable() -> Path:
    from venv_builds import run_script  # under the lock of the build the session started in the background

    r = run_script("checkov_venv.sh", timeout=900)
    if r.returncode != 0:
        pytest.fail(
            "could not set up checkov in .venv-checkov with scripts/checkov_venv.sh "
            f"(exit {r.returncode}); it needs the Python package index to install checkov once. "
            f"Output:\n{(r.stdout + r.stderr)[-3000:]}",
            pytrace=False,
        )
    exe = Path(r.stdout.strip().splitlines()[-1])
    assert exe.is_file(), f"scripts/checkov_venv.sh reported {exe}, which does not exist"
    return exe


def _checkov_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BC_", "PRISMA_", "CKV_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    env.update({
        "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true",  # no PyPI version check
        "BC_SKIP_MAPPING": "TRUE",  # no Prisma Cloud guideline mapping
        "DOWNLOAD_EXTERNAL_MODULES": "false",  # modules are local paths anyway
        "HTTP_PROXY": CLOSED_LOOPBACK, "HTTPS_PROXY": CLOSED_LOOPBACK, "ALL_PROXY": CLOSED_LOOPBACK,
        "http_proxy": CLOSED_LOOPBACK, "https_proxy": CLOSED_LOOPBACK, "all_proxy": CLOSED_LOOPBACK,
        "NO_PROXY": "", "no_proxy": "",
    })
    return env


def _inline_skips() -> dict[tuple[str, str], str]:
    """{(path relative to terraform/, check id): reason} for every ``#checkov:skip`` comment."""
    skips = {}
    for path in TF_FILES:
        for line in path.read_text().splitlines():
            m = re.search(r"#\s*checkov:skip=([A-Z0-9_]+)(?::(.*))?$", line)
            if m:
                skips[(str(path.relative_to(TF_ROOT)), m.group(1))] = (m.group(2) or "").strip()
    return skips


@pytest.fixture(scope="module")
def checkov_report() -> dict:
    exe = _checkov_executable()
    r = subprocess.run(
        [str(exe), "--directory", str(TF_ROOT), "--framework", "terraform", "--skip-download", "--output", "json"],
        cwd=REPO, env=_checkov_env(), capture_output=True, text=True, timeout=600,
    )
    assert r.stdout.strip(), f"checkov printed no report (exit {r.returncode}):\n{r.stderr[-3000:]}"
    report = json.loads(r.stdout)
    if isinstance(report, list):  # one entry per framework; we asked for terraform only
        (report,) = [x for x in report if x.get("check_type") == "terraform"]
    return report


def test_checkov_reports_zero_failed_checks(checkov_report):
    summary = checkov_report["summary"]
    failed = checkov_report["results"]["failed_checks"]
    listing = "\n".join(f"  {c['check_id']} {c['resource']} ({c['file_path']}): {c['check_name']}" for c in failed)
    assert summary["failed"] == 0, f"checkov failed checks:\n{listing}"
    assert summary["parsing_errors"] == 0, f"checkov could not parse: {checkov_report['results'].get('parsing_errors')}"
    assert summary["passed"] > 0, "checkov passed no check at all: did it scan terraform/?"


def test_every_checkov_skip_is_justified_inline_and_used(checkov_report):
    inline = _inline_skips()
    for (path, check_id), reason in inline.items():
        assert len(reason) >= 30, (f"{path}: #checkov:skip={check_id} needs a real reason after the colon, "
                                   f"got {reason!r}")
    skipped = checkov_report["results"]["skipped_checks"]
    used = set()
    for c in skipped:
        rel = c["file_path"].lstrip("/")
        assert (rel, c["check_id"]) in inline, (
            f"checkov skipped {c['check_id']} for {c['resource']} in {rel} without an inline "
            f"#checkov:skip={c['check_id']}:<reason> in that file"
        )
        used.add((rel, c["check_id"]))
    stale = sorted(set(inline) - used)
    assert not stale, f"inline skips that checkov no longer needs (remove them): {stale}"


# ---------------------------------------------------------------------------
# what the modules must do (structure)
# ---------------------------------------------------------------------------


def test_s3_lifecycle_aborts_incomplete_multipart_uploads_bucket_wide():
    # Also the evidence behind the CKV_AWS_300 skip: checkov cannot see this rule.
    docs = _module_docs(S3_MODULE)
    lc = _labelled(docs, "resource")[("aws_s3_bucket_lifecycle_configuration", "this")]
    static_rules = lc.get("rule", [])
    abort = [r for r in static_rules if r.get("abort_incomplete_multipart_upload")]
    assert len(abort) == 1, "expected one static rule with abort_incomplete_multipart_upload"
    rule = abort[0]
    assert _unq(rule["status"]) == "Enabled"
    assert [{k: v for k, v in f.items() if not k.startswith("__")} for f in rule["filter"]] == [{}], \
        "the abort rule must have an empty filter (whole bucket)"
    assert (rule["abort_incomplete_multipart_upload"][0]["days_after_initiation"]
            == "${var.abort_incomplete_multipart_days}")
    default = _named(docs, "variable")["abort_incomplete_multipart_days"]["default"]
    assert default == 3


def test_gcs_lifecycle_aborts_incomplete_multipart_uploads():
    docs = _module_docs(GCS_MODULE)
    bucket = _labelled(docs, "resource")[("google_storage_bucket", "this")]
    rules = [r for r in bucket["lifecycle_rule"] if _unq(r["action"][0]["type"]) == "AbortIncompleteMultipartUpload"]
    assert len(rules) == 1
    condition = {k: v for k, v in rules[0]["condition"][0].items() if not k.startswith("__")}
    assert condition == {"age": "${var.abort_incomplete_multipart_days}"}, "the abort rule must apply bucket-wide"
    assert _named(docs, "variable")["abort_incomplete_multipart_days"]["default"] == 3


def test_s3_bucket_policy_denies_requests_without_tls():
    docs = _module_docs(S3_MODULE)
    doc = _labelled(docs, "data")[("aws_iam_policy_document", "bucket")]
    deny = [s for s in doc["statement"] if _unq(s.get("effect")) == "Deny"
            and any(_unq(c["variable"]) == "aws:SecureTransport" and c["values"] in (['"false"'], ["false"])
                    for c in s.get("condition", []))]
    assert deny, "no Deny statement on aws:SecureTransport = false"
    assert deny[0]["actions"] in (['"s3:*"'], ["s3:*"])
    resources = _labelled(docs, "resource")
    assert resources[("aws_s3_bucket_policy", "this")]["policy"] == "${data.aws_iam_policy_document.bucket.json}"


def test_public_access_is_blocked_on_both_clouds():
    s3 = _labelled(_module_docs(S3_MODULE), "resource")
    pab = s3[("aws_s3_bucket_public_access_block", "this")]
    for flag in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets"):
        assert pab[flag] is True, flag
    assert (_unq(s3[("aws_s3_bucket_ownership_controls", "this")]["rule"][0]["object_ownership"])
            == "BucketOwnerEnforced")
    gcs = _labelled(_module_docs(GCS_MODULE), "resource")[("google_storage_bucket", "this")]
    assert _unq(gcs["public_access_prevention"]) == "enforced"
    assert gcs["uniform_bucket_level_access"] is True


def _statements(doc: dict) -> dict[str, dict]:
    return {_unq(s["sid"]): s for s in doc["statement"]}


def _actions(s: dict) -> set[str]:
    return {_unq(a) for a in s["actions"]}


def _resources(s: dict) -> list[str]:
    r = s["resources"]
    return [_unq(x) for x in ([r] if isinstance(r, str) else r)]


def test_s3_trainer_and_evaluator_policies_are_scoped_to_the_prefixes():
    docs = _module_docs(S3_MODULE)
    data = _labelled(docs, "data")
    trainer = _statements(data[("aws_iam_policy_document", "trainer")])
    evaluator = _statements(data[("aws_iam_policy_document", "evaluator")])
    # Object access only on the prefix ARNs, never the whole bucket.
    for stmts in (trainer, evaluator):
        for s in stmts.values():
            for res in _resources(s):
                assert res in ("${aws_s3_bucket.this.arn}", "${local.object_arns}", "${statement.value}"), res
            assert not any("*" == a.split(":")[-1] for a in _actions(s)), f"wildcard action in {s}"
    assert _resources(trainer["ReadWriteDeleteCheckpoints"]) == ["${local.object_arns}"]
    assert _resources(evaluator["ReadCheckpoints"]) == ["${local.object_arns}"]
    iam = (S3_MODULE / "iam.tf").read_text()
    assert 'object_arns          = [for p in local.access_prefixes : "${aws_s3_bucket.this.arn}/${p}*"]' in iam
    assert _actions(trainer["ReadWriteDeleteCheckpoints"]) == {
        "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"}
    assert "s3:ListBucketMultipartUploads" in _actions(trainer["BucketLevelReads"])
    # Evaluators read, nothing else.
    ev_actions = set().union(*(_actions(s) for s in evaluator.values()))
    assert ev_actions == {"s3:ListBucket", "s3:GetBucketLocation", "s3:GetObject"}
    # Listing is limited by s3:prefix to the same prefixes.
    for stmts in (trainer, evaluator):
        cond = stmts["ListCheckpointPrefixes"]["condition"][0]
        assert _unq(cond["variable"]) == "s3:prefix"
        assert cond["values"] in ("${local.list_prefix_patterns}", ["${local.list_prefix_patterns}"])
    # Trainers can delete objects but never object versions (versioning stays a safety net).
    trainer_actions = set().union(*(_actions(s) for s in trainer.values()))
    assert not {a for a in trainer_actions if "Version" in a}, trainer_actions


@needs_terraform
@pytest.mark.parametrize("module_key", ["s3", "gcs"])
def test_access_prefixes_end_with_a_slash_and_include_the_ephemeral_prefix(tmp_path, module_key):
    got = _console(tmp_path, module_key, "local.access_prefixes",
                   {"run_prefix": "team-a/runs", "ephemeral_prefix": "scratch"})
    assert got == ["team-a/runs/", "scratch/"]
    got = _console(tmp_path, module_key, "local.access_prefixes", {})
    assert got == ["runs/"]


@needs_terraform
@pytest.mark.parametrize("module_key", ["s3", "gcs"])
@pytest.mark.parametrize(
    "run_prefix, ephemeral_prefix, covers",
    [
        ("runs", "runs", True),  # same prefix: the expiry rule would eat every checkpoint
        ("team/runs", "team", True),  # persistent runs nested inside the ephemeral prefix
        ("runs", "runs/scratch", False),  # ephemeral nested inside runs is fine
        ("runs", "run", False),  # "run/" is not a prefix of "runs/"
        ("runs", "scratch", False),
    ],
)
def test_ephemeral_prefix_that_would_expire_persistent_runs_is_detected(tmp_path, module_key, run_prefix,
                                                                         ephemeral_prefix, covers):
    got = _console(tmp_path, module_key, "local.ephemeral_covers_runs",
                   {"run_prefix": run_prefix, "ephemeral_prefix": ephemeral_prefix})
    assert got is covers
    main = (MODULES[module_key] / "main.tf").read_text()
    assert "condition     = !local.ephemeral_covers_runs" in main, "the guard must be a precondition"


def test_gcs_bindings_carry_the_prefix_condition():
    docs = _module_docs(GCS_MODULE)
    resources = _labelled(docs, "resource")
    bindings = {name: body for (typ, name), body in resources.items() if typ == "google_storage_bucket_iam_member"}
    assert set(bindings) == {"trainer_sa", "trainer", "reader"}
    for name, body in bindings.items():
        assert body["condition"][0]["expression"] == "${local.prefix_condition_expression}", name
    assert _unq(bindings["trainer_sa"]["role"]) == "roles/storage.objectAdmin"
    assert _unq(bindings["trainer"]["role"]) == "roles/storage.objectAdmin"
    assert _unq(bindings["reader"]["role"]) == "roles/storage.objectViewer"
    iam = (GCS_MODULE / "iam.tf").read_text()
    assert 'resource.name.startsWith(\\"projects/_/buckets/${google_storage_bucket.this.name}/objects/${p}\\")' in iam


def test_save_folder_outputs_point_at_the_run_prefix():
    s3 = _named(_module_docs(S3_MODULE), "output")
    assert _unq(s3["save_folder"]["value"]) == "s3://${aws_s3_bucket.this.id}/${var.run_prefix}"
    gcs = _named(_module_docs(GCS_MODULE), "output")
    assert _unq(gcs["save_folder"]["value"]) == "gs://${google_storage_bucket.this.name}/${var.run_prefix}"
    for examples in EXAMPLES.values():
        assert (_unq(_named(_module_docs(examples), "output")["save_folder"]["value"])
                == "${module.checkpoints.save_folder}")


# ---------------------------------------------------------------------------
# variables: descriptions, references, validations
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("folder", [*MODULES.values(), *EXAMPLES.values()], ids=lambda p: p.name)
def test_every_variable_and_output_is_described(folder: Path):
    docs = _module_docs(folder)
    for kind in ("variable", "output"):
        for name, body in _named(docs, kind).items():
            assert len(_unq(body.get("description", ""))) > 10, f"{folder.name}: {kind} {name} has no description"


@pytest.mark.parametrize("folder", [*MODULES.values(), *EXAMPLES.values()], ids=lambda p: p.name)
def test_every_var_and_local_reference_is_declared(folder: Path):
    """What `terraform validate` would catch first, checked without providers."""
    docs = _module_docs(folder)
    declared_vars = set(_named(docs, "variable"))
    declared_locals = {k for doc in docs for block in doc.get("locals", []) for k in block if not k.startswith("__")}
    text = "\n".join(p.read_text() for p in folder.glob("*.tf"))
    used_vars = set(re.findall(r"\bvar\.([A-Za-z_][A-Za-z0-9_]*)", text))
    used_locals = set(re.findall(r"\blocal\.([A-Za-z_][A-Za-z0-9_]*)", text))
    assert used_vars <= declared_vars, f"undeclared variables: {sorted(used_vars - declared_vars)}"
    assert used_locals <= declared_locals, f"undeclared locals: {sorted(used_locals - declared_locals)}"
    assert declared_vars <= used_vars, f"unused variables: {sorted(declared_vars - used_vars)}"


@pytest.mark.parametrize("example", list(EXAMPLES.values()), ids=lambda p: p.name)
def test_examples_pass_only_declared_module_arguments(example: Path):
    for name, call in _named(_module_docs(example), "module").items():
        source = _unq(call["source"])
        module_dir = (example / source).resolve()
        assert module_dir.is_dir(), f"module {name}: source {source} does not exist"
        variables = _named(_module_docs(module_dir), "variable")
        args = {k for k in call if k != "source" and not k.startswith("__")}
        assert args <= set(variables), f"module {name}: unknown arguments {sorted(args - set(variables))}"
        required = {v for v, body in variables.items() if "default" not in body}
        assert required <= args, f"module {name}: missing required arguments {sorted(required - args)}"


@pytest.mark.parametrize("module_key", ["s3", "gcs"])
def test_every_days_variable_has_a_range_validation(module_key):
    for name, body in _named(_module_docs(MODULES[module_key]), "variable").items():
        if name.endswith("_days"):
            conditions = " ".join(v["condition"] for v in body.get("validation", []))
            assert "<=" in conditions and ">=" in conditions and "floor(" in conditions, \
                f"{name} lacks a whole-day range check"


@needs_terraform
@pytest.mark.parametrize("module_key", ["s3", "gcs"])
def test_defaults_pass_the_variable_validations(tmp_path, module_key):
    r = _plan(tmp_path, module_key, {})
    assert r.returncode == 0, r.stdout + r.stderr


@needs_terraform
@pytest.mark.parametrize(
    "module_key, overrides",
    [
        ("s3", {"bucket_name": "team-a-checkpoints", "run_prefix": "team-a/runs", "ephemeral_prefix": "scratch",
                "kms_key_arn": "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab",
                "transition_days": "30", "transition_storage_class": "STANDARD_IA",
                "abort_incomplete_multipart_days": "1"}),
        ("gcs", {"bucket_name": "team_a-checkpoints", "ephemeral_prefix": "scratch", "soft_delete_retention_days": "7",
                 "kms_key_name": "projects/p/locations/us-central1/keyRings/r/cryptoKeys/k", "transition_days": "60",
                 "reader_members": '["group:ml@example.com"]'}),
    ],
    ids=["s3", "gcs"],
)
def test_realistic_values_pass_the_variable_validations(tmp_path, module_key, overrides):
    r = _plan(tmp_path, module_key, overrides)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_terraform
@pytest.mark.parametrize(
    "module_key, var, value, message",
    [
        ("s3", "bucket_name", "ab", "must be 3-63 characters"),
        ("s3", "bucket_name", "My-Bucket", "must be 3-63 characters"),
        ("s3", "bucket_name", "dotted.bucket.name", "dots are not allowed"),
        ("s3", "bucket_name", "-leading-hyphen", "must be 3-63 characters"),
        ("s3", "bucket_name", "x" * 64, "must be 3-63 characters"),
        ("s3", "bucket_name", "xn--punycode", "S3 reserves"),
        ("s3", "bucket_name", "mybucket-s3alias", "S3 reserves"),
        ("s3", "run_prefix", "/runs", "no leading or trailing slash"),
        ("s3", "run_prefix", "runs/", "no leading or trailing slash"),
        ("s3", "run_prefix", "a//b", "single slashes"),
        ("s3", "ephemeral_prefix", "../x", "ephemeral_prefix must be null"),
        ("s3", "abort_incomplete_multipart_days", "0", "from 1 to 365"),
        ("s3", "abort_incomplete_multipart_days", "1.5", "whole number"),
        ("s3", "ephemeral_expiration_days", "0", "from 1 to 3650"),
        ("s3", "transition_storage_class", "GLACIER", "readable without a restore"),
        ("s3", "kms_key_arn", "alias/foo", "KMS key ARN"),
        ("s3", "minimum_tls_version", "1.0", "1.2"),
        ("s3", "trainer_role_max_session_duration", "60", "between 3600 and 43200"),
        ("gcs", "bucket_name", "goog-checkpoints", "may not start with \"goog\""),
        ("gcs", "bucket_name", "my-google-bucket", "may not start with \"goog\""),
        ("gcs", "bucket_name", "dotted.name", "3-63 characters"),
        ("gcs", "soft_delete_retention_days", "3", "0 (off) or a whole number of days from 7 to 90"),
        ("gcs", "soft_delete_retention_days", "91", "from 7 to 90"),
        ("gcs", "abort_incomplete_multipart_days", "400", "from 1 to 365"),
        ("gcs", "transition_storage_class", "STANDARD", "NEARLINE, COLDLINE, ARCHIVE"),
        ("gcs", "kms_key_name", "my-key", "projects/<project>"),
        ("gcs", "trainer_service_account_id", "Trainer", "6-30 characters"),
        ("gcs", "reader_members", '["allUsers"]', "are not accepted"),
        ("gcs", "project_id", "x", "project ID"),
    ],
)
def test_invalid_values_are_rejected_by_the_variable_validations(tmp_path, module_key, var, value, message):
    r = _plan(tmp_path, module_key, {var: value})
    out = " ".join((r.stdout + r.stderr).split())  # terraform wraps long messages
    assert r.returncode != 0, f"{module_key}: {var}={value!r} was accepted"
    assert "Invalid value for variable" in out and message in out, out[-2000:]


# ---------------------------------------------------------------------------
# documentation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("module", list(MODULES.values()), ids=lambda p: p.name)
def test_module_readme_covers_usage_offline_limits_and_library_retention(module: Path):
    readme = (module / "README.md").read_text()
    for needle in ("```hcl", 'source = "', "terraform init", "terraform validate", "save_folder",
                   "gc", "ephemeral", "keep_last_ephemeral", ".metadata.json"):
        assert needle in readme, f"{module.name}/README.md does not mention {needle!r}"


def test_operations_page_exists_and_links_the_modules():
    page = REPO / "docs" / "operations.md"
    text = page.read_text()
    assert text.startswith("# "), "docs/operations.md needs a title"
    for needle in ("s3-checkpoint-bucket", "gcs-checkpoint-bucket", "lifecycle", "cloudckpt gc", "cost"):
        assert needle in text, f"docs/operations.md does not mention {needle!r}"
