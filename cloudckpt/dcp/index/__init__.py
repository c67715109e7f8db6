"""The DCP index: what a rank's load planning needs from a step's DCP metadata, in a
form that no rank has to read or parse whole.

DCP's ``.metadata`` describes every item of every rank (``R x T`` chunks for ``T``
sharded tensors): 1.6 GB at 4,096 ranks for a 70B model with AdamW, parsed by every
rank of a stock DCP load. Our writer also writes, beside it (``.metadata`` stays, so
stock DCP and other tools read the step as before):

``index/header.json`` (rank 0, listed in the marker itself)
    every key of the checkpoint: a tensor's dtype and size, and either its one item
    (a tensor stored whole: unsharded or replicated) or the id of its chunk layout; a
    non-tensor value's item. Each distinct chunk layout (the chunks' offsets and sizes
    and the rank that wrote each) is written once, however many tensors share it: a
    transformer's sharded tensors have a handful of shapes, so the header grows with
    ``T + layouts x R``, not ``T x R``. A layout that only one tensor uses (a tensor of
    a shape of its own, or a replicated tensor the balanced save cut into pieces) also
    carries its chunks' items, so loading it reads no part: a data-parallel load would
    otherwise read the parts of every rank that wrote a piece.
``index/rank{R}.json`` (rank R, listed in its manifest part)
    the items of rank R's chunks of sharded tensors: key, chunk offsets and sizes, file,
    offset, length.

A loading rank reads the header (rank 0 reads it once and hands it to every rank),
picks, for each tensor it loads, the chunks its own shards overlap (:func:`select`),
reads the index parts of the ranks that wrote them (a restart with the saved layout:
its own), and hands DCP a ``Metadata`` holding only those chunks
(:func:`build_metadata`), so DCP's planning costs what the rank loads.

Every byte is hostile until checked (docs/security.md): the header and the parts are
CRC-checked against the manifest before they are parsed (``untrusted.read_checked``),
parsed by ``untrusted.loads_json``, and then checked (``decode``): names, dtypes from an
allowlist, sizes within ``[0, 2^63)``, every layout inside its tensor, disjoint and
covering it (checked once per layout and size), owners within the saved world size,
items only in their rank's own shard files, every chunk a rank needs present in its
owner's part with the layout's sizes. What a part or the header holds is never used
to name a path outside ``model_and_optim/``.

The package, one module per job:

- ``encode``: the writer's side (:func:`header_bytes` on the coordinator, :func:`part_items`
  and :func:`part_bytes` on each rank) and the layouts' compact forms;
- ``decode``: the format, parsing and checking (:func:`parse_header`, :func:`parse_part`,
  the ``check_*`` functions against the step), the only reader of an index's bytes;
- ``select``: a rank's load planning from a checked header (:func:`select`,
  :func:`writers_read`, :func:`build_metadata`, :func:`wanted_boxes`).
"""

from .decode import (
    FORMAT,
    HEADER_VERSIONS,
    MAX_INDEX_BYTES,
    MAX_KEY_CHARS,
    MAX_RANKS,
    VERSION,
    Header,
    Layout,
    Tensor,
    check_items,
    check_owners,
    check_part,
    check_tensor_bytes,
    parse_header,
    parse_part,
)
from .encode import HEADER_VERSION, dtype_name, header_bytes, header_from_layouts, layout_key, part_bytes, part_items
from .select import Wanted, build_metadata, select, wanted_boxes, writers_read

__all__ = [
    "FORMAT",
    "HEADER_VERSION",
    "HEADER_VERSIONS",
    "MAX_INDEX_BYTES",
    "MAX_KEY_CHARS",
    "MAX_RANKS",
    "VERSION",
    "Header",
    "Layout",
    "Tensor",
    "Wanted",
    "build_metadata",
    "check_items",
    "check_owners",
    "check_part",
    "check_tensor_bytes",
    "dtype_name",
    "header_bytes",
    "header_from_layouts",
    "layout_key",
    "parse_header",
    "parse_part",
    "part_bytes",
    "part_items",
    "select",
    "wanted_boxes",
    "writers_read",
]
