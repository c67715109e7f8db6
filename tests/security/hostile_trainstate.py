"""Classes 2, 3, 4 and 6 of the issue through the train state and DCP byte items.

A hostile writer of a bucket or a shared folder replaces ``train/rank0.pt`` (the
marker rewritten to match its size and CRC32C) or a DCP byte item (the non-tensor
value ``extra.n``; ``.metadata`` and the marker rewritten to match) with a crafted
``torch.save`` archive:

- class 2, memory safety: numpy arrays other than the exact RNG state (the issue's
  object array with a short state, a shape that lies about its bytes, a list for
  bytes, big-endian or structured dtypes, ``RandomState`` itself), a bool tensor
  holding 7;
- class 3, memory never written: ``torch.Tensor(n)``, ``UntypedStorage(n)``,
  numpy's ``_reconstruct`` without its state, a view past its storage (torch's
  ``set_`` grows the storage), a storage longer than its record;
- class 4, depth: lists, dicts and a dict key tuple nested 10^5-10^6 deep, a cycle,
  a container changed after it was placed;
- class 6, bombs: an object array of 2^31 elements, ``bytearray(2**30)`` six times,
  a deflated data.pkl that inflates to 1.25 GiB, a deflated storage record, a
  storage that declares 2^40 elements, a stride-0 view of 2^40 elements, 2^60 leaves
  from shared tuples, 10^6 dicts, ``torch.Size``/``set`` copies of one memoised
  argument, 4,000 int keys whose hashes collide.

Every one is refused with a typed error by every entry point that reads it (``load``
in both modes, ``resume``, Lightning, ``inspect`` and ``verify`` for the train state;
the DCP readers for the byte item). The crafting functions are also used in process by
``test_trainstate_parser.py``."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import numpy as np
import torch

from cloudckpt.dcp.assemble_store import crc32c_combine

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct


class Reduce:
    """Pickles as ``func(*args)`` followed by ``BUILD state`` (when given): the way a
    hostile writer makes torch.save emit any REDUCE it likes."""

    def __init__(self, func, args, state=None):
        self.r = (func, args) if state is None else (func, args, state)

    def __reduce__(self):
        return self.r


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def archive(pkl: bytes, storages: dict[str, bytes] | None = None, *, compress: set[str] = frozenset(),
            byteorder: bytes | None = b"little", prefix: str = "archive") -> bytes:
    """A zip laid out as torch.save lays it out, with ``pkl`` as ``data.pkl``; records
    named in ``compress`` (``"data.pkl"``, ``"data/0"``) are deflated."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        recs = {"data.pkl": pkl, **({"byteorder": byteorder} if byteorder is not None else {}),
                **{f"data/{k}": v for k, v in (storages or {}).items()}}
        for name, data in recs.items():
            z.writestr(f"{prefix}/{name}", data,
                       compress_type=zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED)
    return buf.getvalue()


def records(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {i.filename.split("/", 1)[1]: z.read(i) for i in z.infolist()}


def rezip(data: bytes, *, compress: set[str] = frozenset(), replace: dict[str, bytes] | None = None) -> bytes:
    """An honest archive written again, with some records deflated or replaced."""
    recs = {**records(data), **(replace or {})}
    pkl = recs.pop("data.pkl")
    order = recs.pop("byteorder", None)
    return archive(pkl, {k[5:]: v for k, v in recs.items() if k.startswith("data/")}, compress=compress,
                   byteorder=order)


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's
    crc32_combine, which Python's zlib does not expose): the library's combine with
    zlib's polynomial."""
    return crc32c_combine(crc1, crc2, len2, poly=0xEDB88320)


def _crc32_repeated(data: bytes, times: int) -> int:
    """CRC-32 of ``data * times`` without building it (doubling with crc32_combine)."""
    crc, have = 0, 0  # the CRC of data * have (0 for empty)
    unit, unit_len = zlib.crc32(data), len(data)  # the CRC of data * 2**k, its length
    while times:
        if times & 1:
            crc, have = _crc32_combine(crc, unit, unit_len), have + unit_len
        times >>= 1
        if times:
            unit, unit_len = _crc32_combine(unit, unit, unit_len), 2 * unit_len
    return crc


def inflating_archive(inflated: int) -> bytes:
    """An archive whose data.pkl is a deflated record that inflates to ``inflated`` bytes
    (a valid pickle: PROTO, then ``N0`` pairs, then ``N.``), built without holding the
    inflated bytes. Each 1 MiB piece of ``N0`` pairs ends with a full flush, so its
    compressed bytes are the same every time: they are compressed once and repeated
    (a stream that inflates exactly as one compressed piece by piece)."""
    head, tail, body = b"\x80\x02", b"N.", b"N0" * (1 << 19)
    comp = zlib.compressobj(1, zlib.DEFLATED, -15)
    parts = [comp.compress(head) + comp.flush(zlib.Z_FULL_FLUSH)]
    crc = zlib.crc32(head)
    left = inflated - len(head) - len(tail)
    whole, rest = divmod(left, len(body))
    block = comp.compress(body) + comp.flush(zlib.Z_FULL_FLUSH)
    parts += [block] * whole
    crc = _crc32_combine(crc, _crc32_repeated(body, whole), whole * len(body))
    parts.append(comp.compress(body[:rest]) + comp.compress(tail) + comp.flush())
    crc = zlib.crc32(tail, zlib.crc32(body[:rest], crc))
    raw = b"".join(parts)
    name = b"archive/data.pkl"
    zip64 = inflated >= 0xFFFFFFFF
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45, 0, 8, 0, 0, crc, len(raw),
                        0xFFFFFFFF if zip64 else inflated, len(name), 20 if zip64 else 0) + name
    if zip64:
        local += struct.pack("<HHQQ", 1, 16, inflated, len(raw))
    cd_extra = struct.pack("<HHQ", 1, 8, inflated) if zip64 else b""
    cd = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 45, 45, 0, 8, 0, 0, crc, len(raw),
                     0xFFFFFFFF if zip64 else inflated, len(name), len(cd_extra), 0, 0, 0, 0, 0) + name + cd_extra
    body_len = len(local) + len(raw)
    eocd = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(cd), body_len, 0)
    return local + raw + cd + eocd


# ----------------------------------------------------------------- raw pickle opcodes (protocol 2)
PROTO = b"\x80\x02"


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def s(text: str) -> bytes:
    b = text.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def i(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def nested_lists(depth: int) -> bytes:
    return PROTO + b"]" * depth + b"a" * (depth - 1) + b"."


def nested_tuples(depth: int) -> bytes:
    return PROTO + b")" + b"\x85" * depth + b"."


def deep_tuple_key(depth: int) -> bytes:
    """The issue's metadata example, as a train state: a dict whose key is a tuple nested
    ``depth`` deep (hashing it overflowed the C stack)."""
    return PROTO + b"}K\x00" + b"\x85" * depth + b"K\x01s."


def nested_dicts(depth: int) -> bytes:
    return PROTO + (b"}" + s("k")) * depth + b"N" + b"s" * depth + b"."


def shared_doubling(levels: int) -> bytes:
    """t = (t, t) ``levels`` times: 2**levels leaves from a few bytes per level."""
    return PROTO + b"N" + b"q\x00h\x00\x86" * levels + b"."


def cycle() -> bytes:
    return PROTO + b"]q\x00h\x00a."  # a list appended to itself


def changed_after_placed() -> bytes:
    """L placed in P, then L grows a level: the depth recorded for P would be stale."""
    return PROTO + b"]q\x00]h\x00ah\x00]a."


def many_marks(n: int) -> bytes:
    return PROTO + b"(" * n + b"N."


def many_dicts(n: int) -> bytes:
    return PROTO + b"}" * n + b"N."


def colliding_int_keys(n: int) -> bytes:
    """A dict whose n int keys all hash alike (multiples of 2**61 - 1)."""
    p = (1 << 61) - 1
    body = b"".join(b"\x8a\x10" + (k * p).to_bytes(16, "little", signed=True) + b"N" for k in range(1, n + 1))
    return PROTO + b"}(" + body + b"u."


def size_copies(n: int, copies: int) -> bytes:
    """torch.Size REDUCE ``copies`` times on one memoised n-int tuple (the metadata bomb)."""
    tup = b"(" + b"K\x01" * n + b"tq\x00"
    call = glob("torch", "Size") + b"h\x00\x85R0"
    return PROTO + tup + b"0" + call * copies + b"N."


def set_copies(n: int, copies: int) -> bytes:
    lst = b"](" + b"".join(i(k) for k in range(n)) + b"eq\x00"
    call = glob("__builtin__", "set") + b"h\x00\x85R0"
    return PROTO + lst + b"0" + call * copies + b"N."


def bytearray_n(n: int, times: int = 1) -> bytes:
    call = glob("__builtin__", "bytearray") + i(n) + b"\x85R"
    return PROTO + b"]" + (call + b"a") * times + b"."


def tensor_pickle(*, key: str = "0", storage: str = "FloatStorage", numel: int = 4, offset: int = 0,
                  size: tuple = (4,), stride: tuple = (1,), requires_grad: bool = False, hooks: bytes = b"",
                  extra: bytes = b"", rebuild: str = "_rebuild_tensor_v2", storage_module: str = "torch") -> bytes:
    """A pickle of one tensor the way torch.save writes it, with every field settable."""
    def tup(xs):
        return b"(" + b"".join(i(x) if x < 1 << 31 else b"\x8a\x09" + x.to_bytes(9, "little") for x in xs) + b"t"
    pid = b"(" + s("storage") + glob(storage_module, storage) + s(key) + s("cpu") + (
        i(numel) if numel < 1 << 31 else b"\x8a\x09" + numel.to_bytes(9, "little")) + b"tQ"
    hooks = hooks or glob("collections", "OrderedDict") + b")R"
    return (PROTO + glob("torch._utils", rebuild) + b"(" + pid + i(offset) + tup(size) + tup(stride)
            + (b"\x88" if requires_grad else b"\x89") + hooks + extra + b"tR.")


# ----------------------------------------------------------------- numpy gadgets (class 2)
def numpy_object_array_short_state() -> bytes:
    """The issue's example: an object array whose state has fewer items than its shape."""
    return saved({"step": 1, "rng": Reduce(_reconstruct, (np.ndarray, (0,), b"b"),
                                            (1, (8,), np.dtype("O"), False, [7]))})


def numpy_object_array_huge() -> bytes:
    """An object array of 2**31 elements from a few bytes (16 GiB of pointers)."""
    return saved({"rng": Reduce(_reconstruct, (np.ndarray, (0,), b"b"), (1, (1 << 31,), np.dtype("O"), False, [7]))})


def numpy_u4_wrong_shape(n: int) -> bytes:
    """A uint32 array whose shape claims ``n`` elements and whose bytes hold 624."""
    keys = np.zeros(624, dtype="<u4").tobytes()
    return saved({"rng": ("MT19937", Reduce(_reconstruct, (np.ndarray, (0,), b"b"),
                                            (1, (n,), np.dtype("<u4"), False, keys)), 0, 0, 0.0)})


def numpy_u4_short_bytes() -> bytes:
    return saved({"rng": ("MT19937", Reduce(_reconstruct, (np.ndarray, (0,), b"b"),
                                            (1, (624,), np.dtype("<u4"), False, b"\x01" * 100)), 0, 0, 0.0)})


def numpy_state_list_instead_of_bytes() -> bytes:
    return saved({"rng": ("MT19937", Reduce(_reconstruct, (np.ndarray, (0,), b"b"),
                                            (1, (624,), np.dtype("<u4"), False, [1] * 624)), 0, 0, 0.0)})


def numpy_array_outside_rng_state() -> bytes:
    return saved({"keys": [np.zeros(624, dtype=np.uint32)]})


def numpy_rng_state_bad_pos() -> bytes:
    kind, keys, _, has_gauss, gauss = np.random.RandomState(1).get_state()
    return saved({"rng": (kind, keys, 10**6, has_gauss, gauss)})


def numpy_big_endian_keys() -> bytes:
    kind, keys, pos, has_gauss, gauss = np.random.RandomState(1).get_state()
    return saved({"rng": (kind, keys.astype(">u4"), pos, has_gauss, gauss)})


def numpy_float_array() -> bytes:
    return saved({"x": np.zeros(624, dtype=np.float32)})


def numpy_struct_dtype() -> bytes:
    return saved({"rng": ("MT19937", np.zeros(624, dtype=[("a", "<u4")]), 0, 0, 0.0)})


def numpy_random_state_object() -> bytes:
    return saved({"rng": np.random.RandomState(1)})


def numpy_reconstruct_unbuilt(n: int) -> bytes:
    """numpy's ``_reconstruct`` without the BUILD that fills it: never-written memory."""
    return saved({"x": Reduce(_reconstruct, (np.ndarray, (n,), b"b"))})


# ----------------------------------------------------------------- uninitialised memory (class 3)
def torch_tensor_n(n: int) -> bytes:
    return saved({"x": Reduce(torch.Tensor, (n,))})


def untyped_storage_n(n: int) -> bytes:
    return saved({"x": Reduce(torch.UntypedStorage, (n,))})


def torch_empty(n: int) -> bytes:
    return saved({"x": Reduce(torch.empty, (n,))})


def tensor_past_its_storage() -> bytes:
    """A view of 2**20 floats over a 16-byte storage: torch's set_ would grow the storage
    with unwritten memory."""
    return archive(tensor_pickle(size=(1 << 20,)), {"0": b"\x01" * 16})


def tensor_offset_past_its_storage() -> bytes:
    return archive(tensor_pickle(offset=3, size=(2,)), {"0": b"\x01" * 16})


def storage_longer_than_record() -> bytes:
    return archive(tensor_pickle(numel=1 << 20, size=(1 << 20,)), {"0": b"\x01" * 16})


def storage_record_missing() -> bytes:
    return archive(tensor_pickle(), {})


def tensor_zero_stride_view() -> bytes:
    """2**40 elements over one float by stride 0: a copy of it is a 4 TiB bomb."""
    return archive(tensor_pickle(size=(1 << 40,), stride=(0,), numel=1), {"0": b"\x01" * 4})


def bool_tensor_bad_bytes() -> bytes:
    return archive(tensor_pickle(storage="BoolStorage", numel=4), {"0": b"\x00\x01\x07\xff"})


def many_dicts_archive() -> bytes:
    return archive(many_dicts(10**7))


def deep_lists_archive() -> bytes:
    return archive(nested_lists(10**6))


def deep_key_archive() -> bytes:
    return archive(deep_tuple_key(10**6))


def deep_dicts_archive() -> bytes:
    return archive(nested_dicts(10**5))


def cycle_archive() -> bytes:
    return archive(cycle())


def changed_archive() -> bytes:
    return archive(changed_after_placed())


def doubling_archive() -> bytes:
    return archive(shared_doubling(60))


def size_copies_archive() -> bytes:
    return archive(PROTO + b"]" + (b"(" + b"K\x01" * 64 + b"tq\x00" + b"0") + (
        glob("torch", "Size") + b"h\x00\x85Ra") * 10**6 + b".")


def set_copies_archive() -> bytes:
    return archive(set_copies(100_000, 2000))


def colliding_keys_archive() -> bytes:
    return archive(colliding_int_keys(4000))


def bytearray_archive() -> bytes:
    return archive(bytearray_n(1 << 30, 6))


def inflating_pkl_archive() -> bytes:
    return inflating_archive(1_342_177_280)  # 1.25 GiB


def deflated_storage_archive() -> bytes:
    return rezip(saved({"step": 1, "w": torch.arange(1 << 16, dtype=torch.float32)}), compress={"data/0"})


def storage_2e40_archive() -> bytes:
    return archive(tensor_pickle(numel=1 << 40, size=(1 << 40,)), {"0": b"\x01" * 16})


# ----------------------------------------------------------------- the tries
TRAIN_ENTRIES = ("load", "load_pre_download", "resume", "lightning", "cli_inspect", "cli_verify")
ITEM_ENTRIES = ("load", "load_pre_download", "resume")  # Lightning loads only model and optim tensors from DCP

# case: (class, what, crafting function, unused)
CASES: dict[str, tuple[int, str, object, bool]] = {
    "np-object-short-state": (2, "numpy object array whose state has fewer items than its shape (the issue's "
                                 "SIGSEGV)", numpy_object_array_short_state, True),
    "np-u4-shape-lie": (2, "uint32 array claiming 10^9 elements over 624 elements' bytes",
                        lambda: numpy_u4_wrong_shape(10**9), False),
    "np-u4-short-bytes": (2, "uint32[624] RNG keys with 100 bytes of data", numpy_u4_short_bytes, False),
    "np-state-list": (2, "numpy array state with a list where the bytes go", numpy_state_list_instead_of_bytes, False),
    "np-array-outside-rng": (2, "a numpy array outside numpy's RNG state", numpy_array_outside_rng_state, False),
    "np-rng-bad-pos": (2, "numpy RNG state with position 10^6", numpy_rng_state_bad_pos, False),
    "np-big-endian": (2, "numpy RNG keys of big-endian dtype", numpy_big_endian_keys, False),
    "np-struct-dtype": (2, "numpy RNG keys of a structured dtype", numpy_struct_dtype, False),
    "np-float-array": (2, "a float32 numpy array", numpy_float_array, False),
    "np-randomstate": (2, "numpy.random.RandomState itself", numpy_random_state_object, False),
    "bool-tensor-7": (2, "a bool tensor holding 7 and 255", bool_tensor_bad_bytes, False),
    "torch-tensor-n": (3, "torch.Tensor(15000) (in torch's own allowlist: never-written memory)",
                       lambda: torch_tensor_n(15000), True),
    "untyped-storage-n": (3, "torch.UntypedStorage(15000)", lambda: untyped_storage_n(15000), False),
    "torch-empty-n": (3, "torch.empty(15000)", lambda: torch_empty(15000), False),
    "np-reconstruct-unbuilt": (3, "numpy _reconstruct of 15000 bytes without its state",
                               lambda: numpy_reconstruct_unbuilt(15000), True),
    "view-past-storage": (3, "a tensor of 2^20 floats over a 16-byte storage (set_ would grow it)",
                          tensor_past_its_storage, False),
    "offset-past-storage": (3, "a tensor whose offset runs past its storage", tensor_offset_past_its_storage, False),
    "storage-longer-than-record": (3, "a storage declaring 2^20 floats over a 16-byte record",
                                   storage_longer_than_record, False),
    "deep-lists": (4, "lists nested 10^6 deep", deep_lists_archive, True),
    "deep-tuple-key": (4, "a dict key tuple nested 10^6 deep (hashing it overflowed the C stack)",
                       deep_key_archive, True),
    "deep-dicts": (4, "dicts nested 10^5 deep", deep_dicts_archive, False),
    "cycle": (4, "a list that holds itself", cycle_archive, False),
    "changed-after-placed": (4, "a list grown after it was placed in another", changed_archive, False),
    "np-object-2e31": (6, "numpy object array of 2^31 elements (16 GiB from 1.4 KB)", numpy_object_array_huge, True),
    "bytearray-2e30-x6": (6, "bytearray(2**30) six times", bytearray_archive, True),
    "deflate-pkl-1.25GiB": (6, "data.pkl deflated, inflating to 1.25 GiB", inflating_pkl_archive, True),
    "deflate-storage": (6, "a tensor's storage record deflated", deflated_storage_archive, False),
    "storage-2e40": (6, "a storage declaring 2^40 floats over a 16-byte record", storage_2e40_archive, False),
    "zero-stride-2e40": (6, "a stride-0 view of 2^40 floats over one float", tensor_zero_stride_view, False),
    "shared-2e60": (6, "tuples sharing one another: 2^60 leaves from 300 bytes", doubling_archive, False),
    "many-dicts": (6, "10^7 empty dicts (10 MB)", many_dicts_archive, False),
    "size-copies": (6, "torch.Size of one memoised tuple 10^6 times, kept", size_copies_archive, False),
    "set-copies": (6, "set() of one memoised 10^5-item list 2000 times", set_copies_archive, False),
    "colliding-keys": (6, "4000 int dict keys with one hash (quadratic inserts)", colliding_keys_archive, False),
}
ITEM_CASES = ("np-object-short-state", "torch-tensor-n", "np-reconstruct-unbuilt", "deep-tuple-key",
              "np-object-2e31", "bytearray-2e30-x6", "deflate-pkl-1.25GiB", "view-past-storage")


def _replace_byte_item(step, data: bytes) -> None:
    """Put ``data`` in place of the DCP byte item ``extra.n``: the items after it in its
    file move, ``.metadata`` and the marker are rewritten to match."""
    import pickle

    from .corpus import META, MODEL

    md = pickle.loads(step.get(META))  # our own honest metadata
    key = next(k for k in md.storage_data if k.fqn == "extra.n")
    info = md.storage_data[key]
    rel = f"{MODEL}/{info.relative_path}"
    old = step.get(rel)
    delta = len(data) - info.length
    for other in md.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += delta
    new = old[:info.offset] + data + old[info.offset + info.length:]
    info.length = len(data)
    step.put(rel, new)
    step.put(META, pickle.dumps(md, protocol=4))


def crafted(case: str) -> bytes:
    """The bytes of ``case``, built once per sandbox (the 1.25 GiB deflate bomb takes
    seconds to compress; every entry point that reads it gets the same bytes)."""
    from .tries import cached

    return cached(f"trainstate-{case}", CASES[case][2])


def attack(tmp: str, root: str, case: str, entry: str, where: str) -> None:
    from cloudckpt.storage import open_store
    from cloudckpt.storage import url as urls

    from .corpus import TRAIN, Step
    from .tries import honest_step, outside_untouched, run_entry

    data = crafted(case)
    step = honest_step(root)
    st = Step(open_store(step), step, urls.join)
    if where == "train":
        st.put(TRAIN, data)
    else:
        _replace_byte_item(st, data)
    with outside_untouched(tmp):
        run_entry(entry, step=step, folder=root, tmp=tmp)


def parse(tmp: str, root: str, case: str, where: str = "train") -> None:
    """The crafted bytes through the parser alone (no storage): what the tries' entry
    points reach (``test_trainstate_parser.py`` runs every case this way)."""
    from cloudckpt.untrusted import load_plain

    load_plain(crafted(case), url=f"{root}/step1/train/rank0.pt", what="train state")


FULL = ("np-object-short-state", "torch-tensor-n", "np-reconstruct-unbuilt", "deep-lists", "deep-tuple-key",
        "np-object-2e31", "bytearray-2e30-x6", "deflate-pkl-1.25GiB", "view-past-storage")
ON_S3 = ("np-object-short-state", "torch-tensor-n", "deep-tuple-key", "deflate-pkl-1.25GiB")


def _tries():
    """Every case through the train state's readers: the issue's own examples through
    all six on a local folder (and one per class on S3), the other variants through
    ``load`` and ``inspect``; the byte-item variants through the DCP readers."""
    from .tries import REFUSED, Try

    out = []

    def add(name: str, entries, backends, where: str) -> None:
        klass, what, _, _ = CASES[name]
        for backend in backends:
            for entry in entries:
                out.append(Try(klass=klass, case=name if where == "train" else f"item-{name}",
                               what=f"{'train state' if where == 'train' else 'DCP byte item'}: {what}", entry=entry,
                               target="tests.security.hostile_trainstate:attack", backend=backend, expect=REFUSED,
                               kwargs={"case": name, "entry": entry, "where": where}, timeout=60.0))

    for name in CASES:
        add(name, TRAIN_ENTRIES if name in FULL else ("load", "cli_inspect"),
            ("local", "s3") if name in ON_S3 else ("local",), "train")
    for name in ITEM_CASES:
        add(name, ITEM_ENTRIES, ("local", "s3") if name in ON_S3[:2] else ("local",), "item")
    return out


TRIES = _tries()
