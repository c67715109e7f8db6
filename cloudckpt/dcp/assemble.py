"""DCP's ``.metadata`` in fragments: a header, one fragment per owner of a share of the
keys, a trailer; their concatenation, in any order of the fragments, is a pickle that
unpickles (``pickle.loads``, stock DCP's reader, ``untrusted.loads_metadata``) to the
``Metadata`` holding every owner's entries. No process ever holds the whole.

The bytes (``pickletools.dis`` shows them)::

    header    PROTO 3, GLOBAL Metadata, EMPTY_TUPLE, NEWOBJ          the instance
              GLOBAL/string, BINPUT k, POP  (k = 3...)               shared names
              EMPTY_DICT MARK                                        its state (fields)
                'state_dict_metadata' EMPTY_DICT BINPUT 0            memo slot 0
                'planner_data'        EMPTY_DICT BINPUT 1 (or None)  memo slot 1
                'storage_data'        EMPTY_DICT BINPUT 2            memo slot 2
                'storage_meta' <value>  'version' <value>
              SETITEMS
    fragment  for each of the three dicts it has entries of:
                BINGET slot, (MARK key value ... SETITEMS)..., POP
    trailer   BUILD STOP                                             state -> instance

A fragment's keys and values are pickled by the C pickler at protocol 3 (no frames)
in its fast mode: it memoises nothing, so no fragment refers to another's objects.
Its memo is filled beforehand with the header's slots: the three dicts (0-2) and the
names every entry repeats (:data:`SHARED`: DCP's metadata classes, ``torch.Size``,
their field names), which the pickler then writes as a 2-byte BINGET each instead of
the name (a fragment is then about 1.2x the size of the same entries in stock DCP's
protocol 4 pickle, which memoises everything). Protocol 4's MEMOIZE cannot be used:
its slot is the unpickler's memo size at that point, which depends on the fragments
before it. The header and trailer depend only on ``storage_meta`` and ``version``:
every rank can make them. The dicts' order of keys is the fragments' (a dict compares equal whatever
its order); a tensor's chunk list is one value, so it must come whole from one owner,
in the order DCP lists chunks (writer rank, then its plan's order).
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from typing import Any, Iterable, Mapping, Union

import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata

from .._torch_compat import StorageInfo

#: The memo slots of Metadata's three dicts (the header's BINPUTs).
SLOTS = {"state_dict_metadata": 0, "planner_data": 1, "storage_data": 2}
#: What the header puts in memo slots 3, 4, ...: the classes and field names of every entry
#: (the same objects the pickler meets: classes, and the interned names of their fields).
SHARED: tuple = (torch.Size, dcp_md.ChunkStorageMetadata, dcp_md.TensorStorageMetadata, dcp_md.TensorProperties,
                 dcp_md.BytesStorageMetadata, dcp_md.MetadataIndex, StorageInfo) + tuple(map(sys.intern, (
                     "offsets", "sizes", "properties", "size", "chunks", "fqn", "offset", "index", "relative_path",
                     "length", "transform_descriptors")))
TRAILER = pickle.BUILD + pickle.STOP
_MEMO = tuple(object() for _ in SLOTS) + SHARED  # the pickler's memo: slot k holds _MEMO[k]
_PROTO = pickle.PROTO + bytes([3])

Entries = Union[Mapping[Any, Any], Iterable[tuple[Any, Any]]]


def _pickled(obj: Any) -> bytes:
    """``obj`` pickled at protocol 3, memoising nothing, with the header's slots known;
    no PROTO, no STOP."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=3)
    p.memo = {id(o): (k, o) for k, o in enumerate(_MEMO)}
    p.fast = True  # no BINPUT: what a fragment holds is its own
    p.dump(obj)
    out = buf.getvalue()
    if out[:2] != _PROTO or out[-1:] != pickle.STOP:  # pragma: no cover - a pickler that writes otherwise
        raise RuntimeError(f"the pickler wrote {out[:4]!r}...{out[-2:]!r}, not a protocol 3 pickle")
    return out[2:-1]


def header(*, planner_data: bool = True, storage_meta: Any = None, version: str | None = CURRENT_DCP_VERSION) -> bytes:
    """The bytes before every fragment: a ``Metadata`` with three empty dicts (memo
    slots 0-2), ``storage_meta`` and ``version`` (DCP's FileSystemWriter writes
    CURRENT_DCP_VERSION). ``planner_data=False``: the field is None (a planner that
    does not flatten), and no fragment may carry planner entries."""
    out = [_PROTO]
    for k, obj in enumerate(SHARED, start=len(SLOTS)):
        name = _global(obj) if isinstance(obj, type) else _string(obj)
        out += [name, pickle.BINPUT + bytes([k]), pickle.POP]
    out += [_global(Metadata), pickle.EMPTY_TUPLE, pickle.NEWOBJ, pickle.EMPTY_DICT, pickle.MARK]
    for name, slot in SLOTS.items():
        out.append(_pickled(name))
        if name == "planner_data" and not planner_data:
            out.append(pickle.NONE)
        else:
            out.append(pickle.EMPTY_DICT + pickle.BINPUT + bytes([slot]))
    out += [_pickled("storage_meta"), _pickled(storage_meta), _pickled("version"), _pickled(version),
            pickle.SETITEMS]
    return b"".join(out)


def _string(text: str) -> bytes:
    data = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _global(cls: type) -> bytes:
    return pickle.GLOBAL + f"{cls.__module__}\n{cls.__qualname__}\n".encode()


def fragment(*, state_dict_metadata: Entries = (), planner_data: Entries = (), storage_data: Entries = ()) -> bytes:
    """One owner's entries of Metadata's three dicts (mappings, or ``(key, value)``
    pairs), as bytes that go between the header and the trailer. Empty: ``b""``."""
    out = []
    for slot, entries in enumerate((state_dict_metadata, planner_data, storage_data)):
        d = dict(entries)
        if not d:
            continue
        body = _pickled(d)
        if body[:1] != pickle.EMPTY_DICT:  # pragma: no cover - a pickler that writes otherwise
            raise RuntimeError(f"the pickler started a dict with {body[:4]!r}")
        out += [pickle.BINGET + bytes([slot]), body[1:], pickle.POP]
    return b"".join(out)


def metadata_bytes(fragments: Iterable[bytes], *, planner_data: bool = True, storage_meta: Any = None,
                   version: str | None = CURRENT_DCP_VERSION) -> bytes:
    """Header, ``fragments``, trailer, joined in memory (tests and small jobs; a job's
    ``.metadata`` is joined in the store: ``assemble_store.assemble_in_store``)."""
    return header(planner_data=planner_data, storage_meta=storage_meta, version=version) + b"".join(fragments) \
        + TRAILER
