"""An oracle that judges what is on storage without cloudckpt's code: objects are
listed and read with the SDKs (boto3, google-cloud-storage) or ``os`` directly, and
markers are read and written as raw JSON following the schema in docs/protocol.md.
A schema drift or a bug in cloudckpt's discovery, marker parsing or storage layer
therefore shows up as a disagreement instead of passing unseen.

Stores are reached the way a user's tools would: ``AWS_ENDPOINT_URL`` and the AWS_*
credentials for ``s3://``, ``STORAGE_EMULATOR_HOST`` for ``gs://``.
"""

from __future__ import annotations

import json
import os
import re

import google_crc32c

MARKER = ".metadata.json"
_STEP = re.compile(r"^step(\d+)$")
_ROOT = re.compile(r"\.replace/[0-9a-f]{32}")  # format 4: a replaced step's objects


def _split(url: str) -> tuple[str, str, str]:
    if url.startswith(("s3://", "gs://")):
        scheme, rest = url[:2], url[5:]
        bucket, _, key = rest.partition("/")
        return scheme, bucket, key
    return "file", "", url[len("file://"):] if url.startswith("file://") else url


def _s3():
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                        region_name=os.environ.get("AWS_REGION", "us-east-1"))


def _gcs_bucket(bucket: str):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="test", credentials=AnonymousCredentials()).bucket(bucket)


def get(url: str) -> bytes | None:
    """The object's bytes, or None if it does not exist."""
    kind, bucket, key = _split(url)
    if kind == "file":
        try:
            with open(key, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
    if kind == "s3":
        try:
            return _s3().get_object(Bucket=bucket, Key=key)["Body"].read()
        except _s3().exceptions.NoSuchKey:
            return None
    blob = _gcs_bucket(bucket).blob(key)
    return blob.download_as_bytes() if blob.exists() else None


def put(url: str, data: bytes) -> None:
    kind, bucket, key = _split(url)
    if kind == "file":
        os.makedirs(os.path.dirname(key), exist_ok=True)
        with open(key, "wb") as f:
            f.write(data)
    elif kind == "s3":
        _s3().put_object(Bucket=bucket, Key=key, Body=data)
    else:
        _gcs_bucket(bucket).blob(key).upload_from_string(data)


def keys(prefix: str) -> dict[str, int]:
    """``{relative name: size}`` of every object under the folder ``prefix``."""
    kind, bucket, key = _split(prefix.rstrip("/") + "/")
    if kind == "file":
        out = {}
        for root, _, files in os.walk(key):
            for n in files:
                p = os.path.join(root, n)
                out[os.path.relpath(p, key)] = os.path.getsize(p)
        return out
    if kind == "s3":
        out = {}
        for page in _s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
            for o in page.get("Contents", []):
                out[o["Key"][len(key):]] = o["Size"]
        return out
    return {b.name[len(key):]: b.size for b in _gcs_bucket(bucket).client.list_blobs(bucket, prefix=key)}


def crc32c(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


def marker(step_url: str) -> dict | None:
    """The step's marker as JSON if it is one of ours (``format: cloudckpt``), else None."""
    data = get(step_url.rstrip("/") + "/" + MARKER)
    if data is None:
        return None
    try:
        d = json.loads(data)
    except ValueError:
        return None
    if not (isinstance(d, dict) and d.get("format") == "cloudckpt"):
        return None
    if isinstance(d.get("parts"), dict):  # format 3: the part references as columns; read (and relisted) as format 2
        c = d["parts"]
        ranks = [r for first, n in c["ranks"] for r in range(first, first + n)]
        d.update(format_version=2, parts=[{"rank": r, "path": f"manifest/rank{r}.json", "size": c["size"][i],
                                           "crc32c": c["crc32c"][8 * i:8 * i + 8], "objects": c["objects"][i],
                                           "bytes": c["bytes"][i]} for i, r in enumerate(ranks)])
    return d


def committed_steps(folder: str) -> list[int]:
    """Steps whose folder holds a marker of ours, ascending."""
    steps = set()
    for rel in keys(folder):
        parts = rel.split("/")
        if len(parts) == 2 and parts[1] == MARKER and _STEP.match(parts[0]):
            steps.add(int(parts[0][4:]))
    return sorted(s for s in steps if marker(f"{folder.rstrip('/')}/step{s}") is not None)


def _base(step_url: str, m: dict) -> str:
    """Where the step's objects are: the step folder, or (format 4: a replaced step) the
    folder its ``root`` names under it."""
    root = m.get("root") if m.get("format_version", 0) >= 4 or "root" in m else None
    if root is not None:
        assert isinstance(root, str) and _ROOT.fullmatch(root), f"{step_url}: a marker root {root!r}"
        return f"{step_url.rstrip('/')}/{root}"
    return step_url.rstrip("/")


def _parts(step_url: str, m: dict, problems: list) -> list[dict]:
    """Format 2: every part the marker lists must exist with its size and CRC32C and
    name the marker's step, save and its rank; returns the objects the parts list."""
    out = []
    for p in m.get("parts", []):
        url = f"{_base(step_url, m)}/{p['path']}"
        data = get(url)
        if data is None or len(data) != p["size"] or crc32c(data) != p["crc32c"]:
            problems.append(f"{url}: manifest part missing or not as the marker says")
            continue
        part = json.loads(data)
        if (part["step"], part["rank"], part["save_id"]) != (m["step"], p["rank"], m["save_id"]):
            problems.append(f"{url}: a part of another step, rank or save")
        out.extend(part["objects"])
    return out


def manifest_paths(step_url: str) -> set[str]:
    """Every object a committed step's manifest lists: the marker's, its parts (format 2)
    and what the parts list."""
    m = marker(step_url)
    paths = {o["path"] for o in m["objects"]} | {p["path"] for p in m.get("parts", [])}
    return paths | {o["path"] for o in _parts(step_url, m, [])}


def verify_step(step_url: str) -> list[str]:
    """Problems of a committed step: every manifest object (format 2: the parts, and
    every object they list) must exist with its size and CRC32C. ``[]`` means complete;
    a missing marker is a problem too."""
    m = marker(step_url)
    if m is None:
        return [f"{step_url}: no marker"]
    problems: list = []
    for o in list(m["objects"]) + _parts(step_url, m, problems):
        url = f"{_base(step_url, m)}/{o['path']}"
        data = get(url)
        if data is None:
            problems.append(f"{url}: missing")
        elif len(data) != o["size"]:
            problems.append(f"{url}: size {len(data)} != {o['size']}")
        elif o.get("crc32c") and crc32c(data) != o["crc32c"]:
            problems.append(f"{url}: crc32c {crc32c(data)} != {o['crc32c']}")
    return problems


def relist(step_url: str, rel: str, data: bytes) -> None:
    """Put ``data`` at ``rel`` of the step and rewrite the marker's manifest entry to
    match it (size, CRC32C, no item chunks): a consistent, crafted step."""
    base = step_url.rstrip('/')
    put(f"{base}/{rel}", data)
    m = marker(step_url)

    def update(objects: list) -> bool:
        for o in objects:
            if o["path"] == rel:
                o.update(size=len(data), crc32c=crc32c(data))
                o.pop("chunks", None)
                return True
        return False

    if not update(m["objects"]):
        for p in m.get("parts", []):  # format 2: the entry is in its rank's part
            part = json.loads(get(f"{base}/{p['path']}"))
            if update(part["objects"]):
                body = json.dumps(part).encode()
                put(f"{base}/{p['path']}", body)
                p.update(size=len(body), crc32c=crc32c(body), bytes=sum(o["size"] for o in part["objects"]))
                break
    m["total_bytes"] = sum(o["size"] for o in m["objects"]) + sum(p["size"] + p["bytes"] for p in m.get("parts", []))
    put(f"{base}/{MARKER}", json.dumps(m).encode())


def unlist_index(step_url: str) -> None:
    """Remove the DCP index's header from the marker (the object stays): what an attacker
    who crafts ``.metadata`` does too, so that loads plan from ``.metadata`` as for a step
    written by another tool."""
    base = step_url.rstrip('/')
    m = marker(step_url)
    m["objects"] = [o for o in m["objects"] if o["path"] != "index/header.json"]
    m["object_count"] = len(m["objects"]) + sum(1 + p["objects"] for p in m.get("parts", []))
    m["total_bytes"] = sum(o["size"] for o in m["objects"]) + sum(p["size"] + p["bytes"] for p in m.get("parts", []))
    put(f"{base}/{MARKER}", json.dumps(m).encode())
