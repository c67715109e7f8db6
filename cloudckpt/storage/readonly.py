"""A base for stores that can only be read (``http(s)://`` sources of published steps).

A subclass implements the reads (``get_bytes``, ``stat``, ``download_fileobj``, and
``open_range`` where it streams) and :meth:`ReadOnlyStore.read_only_error`; every
write, copy, assembly, delete, conditional replace and listing raises that
:class:`~cloudckpt.errors.ReadOnlyLocation` (the subclass says where to save instead).
"""

from __future__ import annotations

from typing import BinaryIO, Iterable, Iterator

from ..errors import ReadOnlyLocation
from .base import ListEntry, ObjectInfo, ObjectStore, PendingUpload, Progress


class ReadOnlyStore(ObjectStore):
    """An :class:`ObjectStore` whose writes, deletes and listings raise ReadOnlyLocation."""

    conditional_replace = False

    def read_only_error(self, url: str, op: str) -> ReadOnlyLocation:
        """The error for ``op`` (a verb: "write", "delete", ...) on ``url``, naming the URL
        without credentials and what to do instead."""
        return ReadOnlyLocation(f"cannot {op} {url}: {self.scheme}:// is read-only", url=url)

    def check_bucket(self, url: str) -> None:
        raise self.read_only_error(url, "save to")

    def put_bytes(self, url: str, data: bytes, *, if_absent: bool = False) -> None:
        raise self.read_only_error(url, "write")

    def upload_fileobj(self, fileobj: BinaryIO, url: str, *, size: int, if_absent: bool = False,
                       progress: Progress = None) -> None:
        raise self.read_only_error(url, "upload to")

    def upload_file(self, local_path: str, url: str, *, if_absent: bool = False, progress: Progress = None) -> int:
        raise self.read_only_error(url, "upload to")

    def copy(self, src_url: str, dst_url: str, *, size: int, src_version: str | None = None,
             progress: Progress = None) -> ObjectInfo:
        raise self.read_only_error(dst_url, "copy to")

    def get_bytes_versioned(self, url: str, *, limit: int | None = None) -> tuple[bytes, str]:
        raise self.read_only_error(url, "update")  # only ever read to replace the object

    def put_bytes_if_match(self, url: str, data: bytes, version: str) -> None:
        raise self.read_only_error(url, "update")

    def _no_assembly(self, url: str) -> ReadOnlyLocation:  # every assembly call raises it
        return self.read_only_error(url, "assemble")

    def delete(self, url: str) -> None:
        raise self.read_only_error(url, "delete")

    def delete_many(self, urls_: Iterable[str]) -> int:
        for u in urls_:
            raise self.read_only_error(u, "delete")
        return 0

    def delete_prefix(self, prefix: str, *, force: bool = False) -> int:
        raise self.read_only_error(prefix, "delete under")

    def abort_multipart_upload(self, upload: PendingUpload) -> None:
        raise self.read_only_error(upload.url, "abort an upload under")

    def list(self, prefix: str, *, delimiter: str | None = "/") -> Iterator[ListEntry]:
        raise self.read_only_error(prefix, "list")
