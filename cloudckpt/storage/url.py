"""Parsing and joining of storage URLs.

A location is a local path (``/data/run``, ``./run``, ``file:///data/run``) or an
object-store URL ``scheme://bucket/key``. Joining keeps the form it was given: a
plain path stays a plain path, a URL stays a URL.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import InvalidURL

_SCHEME_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$", re.DOTALL)  # a listed key may hold a newline


@dataclass(frozen=True)
class BucketRule:
    """What a bucket name may be: ``pattern`` (a full match), at most ``dotted_max``
    characters when it holds dots (each dot-separated part at most 63), never ``..``.
    ``says`` is the rule in words, for the error message."""

    pattern: re.Pattern
    says: str
    dotted_max: int = 63


# The providers' naming rules for a name they would accept, not their reservations
# (an IP address, xn--, goog...: the store refuses those itself, as InvalidURL):
# https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html and
# https://cloud.google.com/storage/docs/buckets#naming. S3 names take no underscore,
# but S3-compatible stores (Ceph, Virtuozzo) do, so s3:// leaves that to the store.
_S3_BUCKET = BucketRule(re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]"),
                        "3-63 lowercase letters, digits, dots or hyphens (underscores where an S3-compatible store "
                        "allows them), starting and ending with a letter or digit, without '..'")
_GCS_BUCKET = BucketRule(re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]"),
                         "3-63 lowercase letters, digits, dots, hyphens or underscores, starting and ending with a "
                         "letter or digit, without '..'; a name with dots may have up to 222 characters, at most 63 "
                         "between two dots", dotted_max=222)
BUCKET_RULES = {"s3": _S3_BUCKET, "s3a": _S3_BUCKET, "gs": _GCS_BUCKET, "gcs": _GCS_BUCKET}
"""The bucket rule of each scheme that has buckets; other schemes (a registered
backend's) get GCS's, the widest."""


def check_bucket_name(scheme: str, bucket: str, url: str) -> None:
    """Raise InvalidURL unless ``bucket`` follows ``scheme``'s naming rule (:data:`BUCKET_RULES`)."""
    rule = BUCKET_RULES.get(scheme, _GCS_BUCKET)
    ok = (rule.pattern.fullmatch(bucket) is not None and ".." not in bucket
          and len(bucket) <= (rule.dotted_max if "." in bucket else 63)
          and all(len(part) <= 63 for part in bucket.split(".")))
    if not ok:
        raise InvalidURL(f"URL {url!r} has an invalid bucket name {bucket!r}: {scheme}:// bucket names are {rule.says}",
                         url=url)


@dataclass(frozen=True)
class ParsedURL:
    """``scheme`` is ``file`` for local paths; ``bucket`` is empty for them and ``key``
    is then an absolute path."""

    scheme: str
    bucket: str
    key: str


def scheme_of(url: str) -> str:
    """The URL's scheme, ``file`` for plain paths. Raises InvalidURL for malformed URLs."""
    if not isinstance(url, (str, os.PathLike)):
        raise InvalidURL(f"expected a path or URL string, got {type(url).__name__}: {url!r}")
    url = os.fspath(url)
    if not url:
        raise InvalidURL("empty path or URL: give a local folder or s3://bucket/prefix or gs://bucket/prefix")
    m = _SCHEME_RE.match(url)
    if m:
        return m.group(1).lower()
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:/", url) and not url.startswith("/"):
        raise InvalidURL(f"malformed URL {url!r}: write scheme://bucket/prefix, e.g. s3://my-bucket/run-7", url=url)
    return "file"


def parse_url(url: str) -> ParsedURL:
    """Split a URL into scheme, bucket and key. Raises InvalidURL."""
    url = os.fspath(url)
    scheme = scheme_of(url)
    if scheme == "file":
        path = url[len("file://"):] if url.startswith("file://") else url
        slash = "/" if path.endswith("/") and path != "/" else ""
        return ParsedURL("file", "", os.path.abspath(os.path.expanduser(path)) + slash)
    if scheme in ("http", "https"):
        raise InvalidURL(http_url_message(url), url=url)
    rest = _SCHEME_RE.match(url).group(2)  # type: ignore[union-attr]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise InvalidURL(f"URL {url!r} has no bucket: write {scheme}://bucket/prefix", url=url)
    check_bucket_name(scheme, bucket, url)
    if "//" in key or key.startswith("/"):
        raise InvalidURL(f"URL {url!r} has an empty path segment ('//'): remove it", url=url)
    return ParsedURL(scheme, bucket, key)


def is_plain_path(url: str) -> bool:
    return scheme_of(url) == "file" and not os.fspath(url).startswith("file://")


def local_path(url: str) -> str | None:
    """The filesystem path a local location names (a plain path as given, a ``file://``
    URL without its scheme), or None for an object-store URL. For code that must have a
    local folder (a download's destination, an export for ``from_pretrained``): it asks
    this instead of looking at the scheme. Raises InvalidURL for a malformed URL."""
    url = os.fspath(url)
    if scheme_of(url) != "file":
        return None
    return url[len("file://"):] if url.startswith("file://") else url


def join(url: str, *parts: str) -> str:
    """Join path parts onto a URL or path, keeping its form."""
    url = os.fspath(url)
    if is_plain_path(url):
        return os.path.join(url, *parts)
    out = url
    for p in parts:
        if not p:
            continue
        out = out.rstrip("/") + "/" + p.lstrip("/") if not out.endswith("://") else out + p.lstrip("/")
    return out


def as_prefix(url: str) -> str:
    """The URL with exactly one trailing slash: a folder prefix."""
    url = os.fspath(url)
    return url.rstrip("/") + "/" if url.rstrip("/") else url


def basename(url: str) -> str:
    return os.fspath(url).rstrip("/").rsplit("/", 1)[-1]


def parent(url: str) -> str:
    url = os.fspath(url).rstrip("/")
    head, _, _ = url.rpartition("/")
    return head if head and not head.endswith(":/") else url


def relative(url: str, base: str) -> str:
    """``url`` relative to the folder ``base`` (both in the same form)."""
    url, base = os.fspath(url), as_prefix(os.fspath(base))
    if is_plain_path(base):
        return os.path.relpath(url, base)
    if not url.startswith(base):
        raise InvalidURL(f"{url!r} is not under {base!r}", url=url)
    return url[len(base):]


def depth(url: str) -> int:
    """Number of non-empty key components below the bucket (or filesystem) root."""
    p = parse_url(url)
    return len([c for c in p.key.split("/") if c])


def _resolved(url: str, resolve) -> str:
    url = os.fspath(url)
    if scheme_of(url) != "file":
        return url  # object stores have no links
    is_url = url.startswith("file://")
    path = url[len("file://"):] if is_url else url
    out = resolve(os.path.abspath(os.path.expanduser(path)))
    if path.endswith("/") and out != "/":
        out += "/"
    return ("file://" + out) if is_url else out


def resolve_local(url: str) -> str:
    """A local path (or ``file://`` URL) with every symbolic link in it resolved
    (``os.path.realpath``), in the form it was given; object-store URLs unchanged.
    The local backend never follows a link, so the user's own folder is resolved once
    here: a ``~/ckpt -> /nfs/x`` link above the save folder keeps working."""
    return _resolved(url, os.path.realpath)


def resolve_step_dir(url: str) -> str:
    """Like :func:`resolve_local` for the parent only: the last component is kept as
    given, so a step folder that is itself a (planted) link is refused by the local
    backend, not followed."""

    def resolve(path: str) -> str:
        head, tail = os.path.split(path)
        return os.path.join(os.path.realpath(head), tail) if tail else os.path.realpath(path)

    return _resolved(url, resolve)


def http_url_message(url: str) -> str:
    """What to write instead of an ``http(s)://host/bucket/prefix`` location to save to
    (http(s):// is read-only: storage/http.py); an S3-compatible endpoint goes into endpoint_url.
    User info (``user:password@``) in the URL is not repeated."""
    m = _SCHEME_RE.match(os.fspath(url))
    scheme, rest = (m.group(1).lower(), m.group(2)) if m else ("http", "")
    host, _, path = rest.partition("/")
    host = host.rpartition("@")[2]
    shown = f"{scheme}://{host}/{path}"
    if host.endswith("storage.googleapis.com"):
        return (f"{shown!r} is an HTTP URL: cloudckpt saves to s3://, gs:// and local paths (it only loads "
                "published steps from http(s)://); "
                f"write gs://{path.strip('/') or 'BUCKET/PREFIX'}")
    path = path.strip("/")
    target = f"s3://{path}" if "/" in path else f"s3://{path or 'BUCKET'}/PREFIX"
    return (f"{shown!r} is an HTTP URL: cloudckpt saves to s3://, gs:// and local paths (it only loads published "
            "steps from http(s)://). For an S3-compatible store "
            f"(MinIO, SeaweedFS, R2, ...) write {target} and put the endpoint {scheme}://{host} into endpoint_url "
            "(--endpoint-url, CLOUDCKPT_ENDPOINT_URL or AWS_ENDPOINT_URL)")
