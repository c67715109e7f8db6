"""DCP's ``.metadata`` in fragments: a header, one fragment per owner of a share of the
keys, a trailer; their concatenation, in any order of the fragments, is a pickle that
unpickles (``pickle.loads``, stock DCP's reader, ``untrusted.loads_metadata``) to the
``Metadata`` holding every owner's entries. No process ever holds the whole.

The bytes (``pickletools.dis`` shows them)::

    header    PROTO 3, GLOBAL Metadata, EMPTY_TUPLE, NEWOBJ          the instance
              EMPTY_DICT MARK                                        its state (fields)
                'state_dict_metadata' EMPTY_DICT BINPUT 0            memo slot 0
                'planner_data'        EMPTY_DICT BINPUT 1 (or None)  memo slot 1
                'storage_data'        EMPTY_DICT BINPUT 2            memo slot 2
                'storage_meta' <value>  'version' <value>
              SETITEMS
    fragment  for each of the three dicts it has entries of:
                BINGET slot, (MARK key value ... SETITEMS)..., POP
    trailer   BUILD STOP                                             state -> instance

A fragment's keys and values are pickled by the C pickler at protocol 3 (explicit
memo indices, no frames) with a memo whose first three slots are reserved, so a
fragment memoises its own objects from slot 3 up and reads only what it wrote itself:
slots 0-2 (the header's three dicts) are the only ones any fragment shares. The
header and trailer depend only on ``storage_meta`` and ``version``: every rank can
make them. The dicts' order of keys is the fragments' (a dict compares equal whatever
its order); a tensor's chunk list is one value, so it must come whole from one owner,
in the order DCP lists chunks (writer rank, then its plan's order).
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Iterable, Mapping, Union

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata

#: The memo slots of Metadata's three dicts (the header's BINPUTs).
SLOTS = {"state_dict_metadata": 0, "planner_data": 1, "storage_data": 2}
TRAILER = pickle.BUILD + pickle.STOP
_RESERVED = tuple(object() for _ in SLOTS)  # keep the pickler's memo indices 0-2 for the header's dicts
_PROTO = pickle.PROTO + bytes([3])
_DICT_HEAD = pickle.EMPTY_DICT + pickle.BINPUT + bytes([len(SLOTS)])  # how the C pickler starts a dict

Entries = Union[Mapping[Any, Any], Iterable[tuple[Any, Any]]]


def _pickled(obj: Any) -> bytes:
    """``obj`` pickled at protocol 3 with memo slots 0-2 reserved; no PROTO, no STOP."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=3)
    p.memo = {id(o): (k, o) for k, o in enumerate(_RESERVED)}
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
    cls = pickle.GLOBAL + f"{Metadata.__module__}\n{Metadata.__qualname__}\n".encode()
    out = [_PROTO, cls, pickle.EMPTY_TUPLE, pickle.NEWOBJ, pickle.EMPTY_DICT, pickle.MARK]
    for name, slot in SLOTS.items():
        out.append(_pickled(name))
        if name == "planner_data" and not planner_data:
            out.append(pickle.NONE)
        else:
            out.append(pickle.EMPTY_DICT + pickle.BINPUT + bytes([slot]))
    out += [_pickled("storage_meta"), _pickled(storage_meta), _pickled("version"), _pickled(version),
            pickle.SETITEMS]
    return b"".join(out)


def fragment(*, state_dict_metadata: Entries = (), planner_data: Entries = (), storage_data: Entries = ()) -> bytes:
    """One owner's entries of Metadata's three dicts (mappings, or ``(key, value)``
    pairs), as bytes that go between the header and the trailer. Empty: ``b""``."""
    out = []
    for slot, entries in enumerate((state_dict_metadata, planner_data, storage_data)):
        d = dict(entries)
        if not d:
            continue
        body = _pickled(d)
        if not body.startswith(_DICT_HEAD):  # pragma: no cover - a pickler that writes otherwise
            raise RuntimeError(f"the pickler started a dict with {body[:4]!r}")
        out += [pickle.BINGET + bytes([slot]), body[len(_DICT_HEAD):], pickle.POP]
    return b"".join(out)


def metadata_bytes(fragments: Iterable[bytes], *, planner_data: bool = True, storage_meta: Any = None,
                   version: str | None = CURRENT_DCP_VERSION) -> bytes:
    """Header, ``fragments``, trailer, joined in memory (tests and small jobs; a job's
    ``.metadata`` is joined in the store: ``assemble_store.assemble_in_store``)."""
    return header(planner_data=planner_data, storage_meta=storage_meta, version=version) + b"".join(fragments) \
        + TRAILER
