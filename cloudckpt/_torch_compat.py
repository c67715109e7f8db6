"""Every private torch API cloudckpt uses, in one place.

Torch may rename or drop any of these in a release without notice. Each entry names
the torch versions it was checked against (the signature and behaviour cloudckpt
relies on); when torch is upgraded, check each one and update its line, or replace
it here with a local copy or a public API. Nothing else in cloudckpt imports a
private torch name: it imports it from here.

(The process-group API of torch.distributed is not here: only ``cloudckpt.dist``
touches it.)
"""

from __future__ import annotations


# ---------------------------------------------------------------------- plain torch
# checked: 2.13. ``_element_size(dtype)``: bytes per element of a dtype (RuntimeError
# for a non-dtype). Used by the DCP writer to size a chunk without a tensor.
from torch._utils import _element_size as element_size

# checked: 2.13. What a pickled ``torch.layout`` calls to come back
# (``_get_layout("torch.strided")``: TensorProperties.layout in DCP's ``.metadata``);
# the metadata unpickler admits it by identity (untrusted/unpickle.py).
from torch.serialization import _get_layout as get_layout

# ---------------------------------------------------------------------- torch.distributed helpers
# checked: 2.13. ``narrow_tensor_by_index(tensor, offsets, sizes)``: the view of
# ``tensor`` at ``offsets`` of ``sizes`` (narrowed only where a size is smaller than
# the tensor's), as DCP's own reader narrows a loaded item.
from torch.distributed._shard._utils import narrow_tensor_by_index

# checked: 2.13. ``_copy_state_dict(state_dict, copy_state_dict, non_blocking=...)``:
# copies every tensor of a state dict into the matching tensor of a preallocated one
# (async saving's staging copy, checkpoint/async_save.py).
from torch.distributed._state_dict_utils import _copy_state_dict as copy_state_dict

# ---------------------------------------------------------------------- torch.distributed.checkpoint (DCP)
# checked: 2.13. ``unflatten_state_dict(state_dict, mapping)``: DCP's flat keys back
# into the nested dicts they were flattened from (``mapping``: key -> path), as DCP's
# load does (integrations/torchtitan.py).
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

# checked: 2.13. ``set_element(root_dict, path, value)``: sets a value at a flattened
# state dict's path, creating the containers on the way (the load planner's
# load_bytes, checkpoint/checkpointer.py).
from torch.distributed.checkpoint._traverse import set_element

# checked: 2.13. ``_split_by_size_and_type(bins, items)``: DCP's own split of write
# items into ``bins`` files of similar size (tensors by size, byte items spread).
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type as split_by_size_and_type

# checked: 2.13. The storage info dataclass (relative_path, offset, length,
# transform_descriptors) DCP pickles into ``.metadata``'s storage_data; the metadata
# unpickler admits it by name (untrusted/unpickle.py).
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

# checked: 2.13. The enum TensorProperties pickles its memory format through; the
# metadata unpickler admits it by identity (untrusted/unpickle.py).
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as MEM_FORMAT_ENCODING

# checked: 2.13. ``_stateful_to_state_dict(state_dict)``: a state dict with every
# Stateful value replaced by its ``state_dict()``, as DCP's save does first (async
# saving stages that, checkpoint/async_save.py).
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict as stateful_to_state_dict


def write_files(writer, planner, file_queue):
    """Write the files of ``file_queue`` (``(path, file name, write items)`` tuples)
    with DCP's FileSystemWriter machinery: the torch Future of its WriteResults.

    checked: 2.13. ``_FileSystemWriter._write_data(planner, file_queue)``: the private
    method ``write_data`` calls once it has split the plan into files; the DCP writer
    (dcp/writer.py) splits the plan itself (more, smaller files) and calls it."""
    return writer._write_data(planner, file_queue)


def caching_save_planner(key: str):
    """A ``DefaultSavePlanner(enable_plan_caching=True)`` whose cached plans are kept
    under ``key``: a save whose local plans match the previous save's with the same key
    sends an empty plan to the coordinator and reuses the global plan and metadata.

    checked: 2.13. ``DefaultSavePlanner._cached_plans_key``: the key of DCP's
    class-level plan caches; by default the class name, i.e. one cache for every save of
    the process, whatever its process group. Callers pass a key naming the group's world
    size and this rank's place in it, so saves over another group never reuse its plans."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = f"cloudckpt:{key}"
    return planner


__all__ = [
    "MEM_FORMAT_ENCODING",
    "StorageInfo",
    "caching_save_planner",
    "copy_state_dict",
    "dtensor_like",
    "element_size",
    "get_layout",
    "narrow_tensor_by_index",
    "set_element",
    "split_by_size_and_type",
    "stateful_to_state_dict",
    "unflatten_state_dict",
    "write_files",
]


# ---------------------------------------------------------------------- DTensor internals
def dtensor_like(local, like):
    """checked: 2.13. A DTensor with ``like``'s placement spec (``DTensor._spec``) over
    the local tensor ``local``, built without a collective or a copy (async saving's
    staging buffers, checkpoint/async_save.py)."""
    from torch.distributed.tensor import DTensor

    return DTensor.__new__(DTensor, local, like._spec, requires_grad=False)
