"""The train-state parser (``cloudckpt.untrusted.trainstate``): what honest writers save
loads exactly as ``torch.load`` loads it, every crafted archive of
``hostile_trainstate.py`` is refused with a typed error (the heavy ones in the
sandbox, where a crash, a bomb or a hang would show), the bounds hold at their
edges, and a hypothesis fuzz of arbitrary bytes, mutated honest archives and random
opcode sequences gives only typed errors or plain data within the bounds.

CI runs a bounded number of examples; for a longer run set ``CLOUDCKPT_FUZZ_EXAMPLES``
(e.g. ``CLOUDCKPT_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/security/test_trainstate_parser.py``).
"""

from __future__ import annotations

import collections
import io
import os
import random
import struct
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.errors import CloudCkptError, UnsafeCheckpoint
from cloudckpt.untrusted import load_plain, plainpickle, trainstate, zipread
from cloudckpt.untrusted.plain import load_tensor

from . import hostile_trainstate as h
from .sandbox import REFUSED

EXAMPLES = int(os.environ.get("CLOUDCKPT_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_COUNTS: collections.Counter = collections.Counter()
URL = "s3://b/run/step1/train/rank0.pt"


def _load(data: bytes):
    return load_plain(data, url=URL)


# ----------------------------------------------------------------- honest data loads as torch.load loads it
def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and a.storage_offset() == b.storage_offset() and a.requires_grad == b.requires_grad
                and a.is_conj() == b.is_conj() and torch.equal(a.resolve_conj(), b.resolve_conj()))
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
    if isinstance(a, dict):
        attrs = (dict(vars(a)), dict(vars(b))) if hasattr(a, "__dict__") else ({}, {})
        return (type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
                and list(attrs[0]) == list(attrs[1]) and all(_same(attrs[0][k], attrs[1][k]) for k in attrs[0]))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _honest() -> dict:
    from cloudckpt.exact_resume import capture

    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 6, generator=g)
    sd = torch.nn.Linear(3, 2).state_dict()  # an OrderedDict with a _metadata attribute
    state = {
        "exact_resume": capture({}),  # what cloudckpt's manager stores
        "hf_rng": {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
        "lightning": {"epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.5.0",
                      "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.batch_progress": {
                          "total": {"ready": 120, "completed": 120}, "is_last_batch": False}}},
                      "callbacks": {"ModelCheckpoint{'monitor': 'loss'}": {
                          "best_model_score": torch.tensor(0.25), "best_k_models": {"a.ckpt": torch.tensor(0.25)},
                          "dirpath": "s3://b/run"}},
                      "lr_schedulers": [{"base_lrs": [0.1], "last_epoch": 3, "_last_lr": [0.05]}],
                      "hyper_parameters": {"lr": 0.1, "layers": [4, 4], "name": None, "dtype": torch.bfloat16}},
        "views": [base, base[1:3], base.t(), base[:, ::2], base.reshape(-1)[5:]],
        "sd": sd,
        "scalars": [None, True, False, 0, -1, 255, 65536, -(2 ** 31), 2 ** 63, -(2 ** 100), 1.5, float("inf"),
                    complex(1, -2), "", "naïve ☃ 𝄞", b"", b"\x00\xff" * 40, bytearray(b"ab")],
        "containers": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), {1, "a", (2, 3)}, frozenset({1.5}),
                       collections.OrderedDict(b=1, a=2), collections.Counter(x=3), torch.Size([2, 3]),
                       torch.device("cpu"), torch.device("cuda", 1), {(1, "k"): "tuple key", 2: "int key"}],
        "tensors": {str(d): torch.ones(3, dtype=d) for d in sorted(trainstate._DTYPES, key=str)
                    if d not in (torch.float8_e4m3fn, torch.float8_e5m2)},
        "special": {"empty": torch.empty(0, 3), "scalar": torch.tensor(7), "grad": torch.ones(2, requires_grad=True),
                    "param": torch.nn.Parameter(torch.ones(2)), "frozen": torch.nn.Parameter(torch.ones(2), False),
                    "conj": torch.tensor([1 + 2j]).conj(), "bool": torch.tensor([True, False, True]),
                    "long_list": list(range(5000)), "big_dict": {f"k{i}": i for i in range(3000)}},
    }
    return state


@pytest.mark.parametrize("protocol", [2, 4])
def test_honest_train_state_loads_exactly_as_torch_load_loads_it(protocol):
    state = _honest()
    buf = io.BytesIO()
    torch.save(state, buf, pickle_protocol=protocol)
    data = buf.getvalue()
    got = _load(data)
    ref = torch.load(io.BytesIO(data), weights_only=False)  # our own honest bytes: trusted
    assert _same(got, ref)
    views = got["views"]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1, "views share their storage as saved"
    views[0][1, 1] = 99.0
    assert views[1][0, 1] == 99.0 and views[2][1, 1] == 99.0
    assert got["sd"]._metadata == ref["sd"]._metadata


def test_loaded_rng_states_restore_every_generator():
    from cloudckpt.exact_resume import capture, restore

    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    saved = h.saved({"er": capture({}), "np": np.random.get_state(), "py": random.getstate(),
                     "t": torch.get_rng_state()})
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    got = _load(saved)
    restore(got["er"], {}, same_world_size=True)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    random.setstate(got["py"])
    np.random.set_state(got["np"])
    torch.set_rng_state(got["t"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
    kind, keys, pos, has_gauss, gauss = got["np"]
    assert keys.dtype == np.uint32 and keys.shape == (624,) and keys.flags.writeable and keys.flags.owndata


def test_an_archive_saved_in_the_other_byte_order_is_byteswapped():
    t = torch.arange(6, dtype=torch.int32) * 1000003
    recs = h.records(h.saved({"t": t}))
    other = b"big" if sys.byteorder == "little" else b"little"
    swapped = t.numpy().byteswap().tobytes()
    data = h.archive(recs["data.pkl"], {"0": swapped}, byteorder=other)
    assert torch.equal(_load(data)["t"], t)
    assert torch.equal(_load(h.archive(recs["data.pkl"], {"0": t.numpy().tobytes()}, byteorder=None))["t"], t)


def test_a_tensor_item_loads_and_anything_else_in_its_place_is_refused():
    t = torch.randn(5, 3)
    assert torch.equal(load_tensor(h.saved(t), url="u", fqn="w"), t)
    assert torch.equal(load_tensor(io.BytesIO(h.saved(t)), url="u", fqn="w"), t)
    assert torch.equal(load_tensor(memoryview(h.saved(t)), url="u", fqn="w"), t)
    with pytest.raises(UnsafeCheckpoint, match="u: refused to load the tensor 'w': the item holds a dict"):
        load_tensor(h.saved({"a": 1}), url="u", fqn="w")


def test_a_tensor_item_on_the_meta_device_reads_no_storage_bytes_and_refuses_the_same_archives():
    t = torch.randn(5, 3)[1:, ::2]
    meta = load_tensor(h.saved(t), url="u", fqn="w", map_location="meta")
    assert meta.device.type == "meta" and meta.dtype == t.dtype and meta.shape == t.shape
    assert meta.stride() == t.stride() and meta.storage_offset() == t.storage_offset()
    assert meta.untyped_storage().nbytes() == t.untyped_storage().nbytes()
    for data in (h.inflating_archive(1 << 20), h.tensor_past_its_storage(), h.storage_2e40_archive(),
                 h.archive(h.bytearray_n(1 << 30, 6))):
        with pytest.raises(UnsafeCheckpoint, match="u: refused to load the tensor 'w'"):
            load_tensor(data, url="u", fqn="w", map_location="meta")


def test_loading_twice_in_threads_gives_the_same_result():
    from concurrent.futures import ThreadPoolExecutor

    data = h.saved(_honest())
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda _: _load(data), range(8)))
    assert all(_same(o, outs[0]) for o in outs)


# ----------------------------------------------------------------- hostile archives
CHEAP = [n for n in h.CASES if n not in ("many-dicts", "size-copies", "set-copies", "deflate-pkl-1.25GiB",
                                         "deep-lists", "deep-dicts")]


@pytest.mark.parametrize("case", CHEAP)
def test_a_crafted_train_state_is_refused_with_a_typed_error_naming_the_url(case):
    with pytest.raises(UnsafeCheckpoint) as ei:
        _load(h.CASES[case][2]())
    assert str(ei.value).startswith(f"{URL}: refused to load the train state: ")


@pytest.fixture
def sandbox(hostile_sandbox):
    return hostile_sandbox  # one zygote per test process (conftest.py)


@pytest.mark.parametrize("case", list(h.CASES))
def test_every_crafted_archive_is_refused_in_the_sandbox_without_crash_bomb_or_hang(case, sandbox):
    """The parser alone, under the sandbox's 4 GiB address space, 1.5 GiB RSS and 60 s."""
    r = sandbox.run("tests.security.hostile_trainstate:parse", tmp="/nonexistent", root="s3://b/run", case=case)
    assert r.outcome == REFUSED and r.error == "cloudckpt.errors.UnsafeCheckpoint", r
    assert r.message.startswith("s3://b/run/step1/train/rank0.pt: refused to load the train state"), r


def test_the_depth_limit_holds_at_its_edge():
    assert _depth(_load(h.archive(h.nested_lists(trainstate.MAX_DEPTH)))) == trainstate.MAX_DEPTH
    assert _depth(_load(h.archive(h.nested_tuples(trainstate.MAX_DEPTH - 1)))) == trainstate.MAX_DEPTH
    for pkl in (h.nested_lists(trainstate.MAX_DEPTH + 1), h.nested_tuples(trainstate.MAX_DEPTH),
                h.nested_dicts(trainstate.MAX_DEPTH + 1), h.deep_tuple_key(trainstate.MAX_DEPTH + 1)):
        with pytest.raises(UnsafeCheckpoint, match="nested more than 100 deep"):
            _load(h.archive(pkl))


def test_sharing_is_allowed_while_the_tree_stays_small_and_refused_when_it_explodes():
    got = _load(h.archive(h.shared_doubling(10)))  # 1024 leaves from 60 bytes: within 4x bytes + 100000
    assert _count_leaves(got) == 1024
    with pytest.raises(UnsafeCheckpoint, match="more values than its size allows"):
        _load(h.archive(h.shared_doubling(20)))


def test_containers_cannot_change_after_they_are_placed():
    for pkl, why in ((h.cycle(), "holds itself"), (h.changed_after_placed(), "after it was placed")):
        with pytest.raises(UnsafeCheckpoint, match=why):
            _load(h.archive(pkl))


def test_dict_keys_are_atoms_small_ints_and_few_tuples():
    p = h.PROTO
    with pytest.raises(UnsafeCheckpoint, match="dict key or set item of type list"):
        _load(h.archive(p + b"}]Ns."))
    with pytest.raises(UnsafeCheckpoint, match="dict key or set item of type int"):
        _load(h.archive(h.colliding_int_keys(3)))
    many = p + b"}(" + b"".join(h.i(k) + b"\x85N" for k in range(plainpickle.MAX_TUPLE_KEYS + 1)) + b"u."
    with pytest.raises(UnsafeCheckpoint, match="tuples used as dict keys"):
        _load(h.archive(many))
    ok = p + b"}(" + b"".join(h.i(k) + b"\x85N" for k in range(100)) + b"u."
    assert len(_load(h.archive(ok))) == 100
    for key in (b"K\x01\x85\x85", b"(" + b"K\x01" * (plainpickle.MAX_TUPLE_KEY_LEN + 1) + b"t"):  # nested, long
        with pytest.raises(UnsafeCheckpoint, match="nested tuple or one of more than"):
            _load(h.archive(p + b"}" + key + b"Ns."))
    flat = p + b"}" + b"(" + b"K\x01" * plainpickle.MAX_TUPLE_KEY_LEN + b"tNs."
    assert list(_load(h.archive(flat))) == [(1,) * plainpickle.MAX_TUPLE_KEY_LEN]


def test_large_honest_plain_data_fits_the_budget():
    """A sampler's million indices and a 200,000-entry dict: within the bounds."""
    big = {"indices": list(range(1_000_000)), "seen": {f"s{i}": i for i in range(200_000)}}
    got = _load(h.saved(big))
    assert got["indices"] == big["indices"] and got["seen"] == big["seen"]


def test_the_value_budget_stops_many_small_objects():
    with pytest.raises(UnsafeCheckpoint, match=f"more than {plainpickle.MAX_CELLS} units of plain data"):
        _load(h.archive(h.many_marks(plainpickle.MAX_CELLS // 6 + 10)))


def test_only_stored_zip_records_are_read():
    honest = h.saved({"w": torch.ones(1000)})
    for rec in ("data.pkl", "data/0"):
        with pytest.raises(UnsafeCheckpoint, match="is compressed"):
            _load(h.rezip(honest, compress={rec}))
    with pytest.raises(UnsafeCheckpoint, match="is compressed"):
        _load(h.inflating_archive(1 << 20))
    with pytest.raises(UnsafeCheckpoint, match="not a readable torch.save archive"):
        _load(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(UnsafeCheckpoint, match="bytes after the zip directory"):
        _load(honest + b"trailing")


def test_zip_records_that_overlap_or_lie_are_refused():
    data = bytearray(h.saved({"w": torch.ones(4)}))
    recs = zipread.records(data)
    start, size = recs["archive/data/0"]
    cd = data.rfind(b"PK\x01\x02")  # the last directory entry
    # point the last record's header at the first record's header: two records in one place
    bad = bytearray(data)
    struct.pack_into("<I", bad, cd + 42, struct.unpack_from("<I", data, data.find(b"PK\x01\x02") + 42)[0])
    with pytest.raises(zipread.BadArchive):
        zipread.records(bytes(bad))
    bad = bytearray(data)
    struct.pack_into("<I", bad, cd + 24, 1 << 31)  # uncompressed size of 2 GiB
    with pytest.raises(zipread.BadArchive, match="declares two sizes"):
        zipread.records(bytes(bad))
    bad = bytearray(data)
    struct.pack_into("<H", bad, cd + 8, 1)  # the encrypted flag
    with pytest.raises(zipread.BadArchive, match="encrypted"):
        zipread.records(bytes(bad))
    assert size == 16


def test_zip64_directories_are_read():
    pkl = h.records(h.saved({"w": torch.arange(4.0)}))["data.pkl"]
    data = _zip64_archive({"archive/data.pkl": pkl, "archive/data/0": torch.arange(4.0).numpy().tobytes()})
    assert set(zipread.records(data)) == {"archive/data.pkl", "archive/data/0"}
    assert torch.equal(_load(data)["w"], torch.arange(4.0))


def _zip64_archive(recs: dict[str, bytes]) -> bytes:
    """Stored records whose directory gives every size and offset in zip64 fields."""
    body, central = b"", b""
    for name, data in recs.items():
        n = name.encode()
        off = len(body)
        body += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45, 0, 0, 0, 0, 0, len(data), len(data), len(n), 0) \
            + n + data
        extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), off)
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 45, 45, 0, 0, 0, 0, 0, 0xFFFFFFFF, 0xFFFFFFFF,
                               len(n), len(extra), 0, 0, 0, 0, 0xFFFFFFFF) + n + extra
    cd_off = len(body)
    eocd64_off = cd_off + len(central)
    eocd64 = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, len(recs), len(recs), len(central), cd_off)
    loc = struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64_off, 1)
    eocd = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return body + central + eocd64 + loc + eocd


def test_tensors_are_built_only_from_their_records():
    assert torch.equal(_load(h.archive(h.tensor_pickle(size=(2, 2), stride=(2, 1)), {"0": b"\x00" * 16})),
                       torch.zeros(2, 2))
    assert _load(h.archive(h.tensor_pickle(size=(0,), offset=4), {"0": b"\x00" * 16})).numel() == 0
    refused = {
        "past the end": h.tensor_pickle(size=(5,)),
        "offset": h.tensor_pickle(size=(2,), stride=(3,), offset=1),
        "negative stride": h.tensor_pickle(size=(2,), stride=(-1,)),
        "overlapping": h.tensor_pickle(size=(8,), stride=(0,)),
        "dims mismatch": h.tensor_pickle(size=(2, 2), stride=(1,)),
        "qint": h.tensor_pickle(storage="QInt8Storage"),
        "v3 with a typed storage": h.tensor_pickle(rebuild="_rebuild_tensor_v3"),
        "v2 with an untyped storage": h.tensor_pickle(storage="UntypedStorage", storage_module="torch.storage",
                                                      numel=16),
        "grad on ints": h.tensor_pickle(storage="IntStorage", requires_grad=True),
        "hooks": h.tensor_pickle(hooks=b"}" + h.s("h") + b"Ns"),
        "metadata neg": h.tensor_pickle(extra=b"}" + h.s("neg") + b"\x88s"),
        "other persistent id": h.PROTO + b"(" + h.s("module") + b"tQ.",
        "sparse": h.PROTO + h.glob("torch._utils", "_rebuild_sparse_tensor") + b").",
        "meta": h.PROTO + h.glob("torch._utils", "_rebuild_meta_tensor_no_storage") + b").",
        "subclass": h.PROTO + h.glob("torch._tensor", "_rebuild_from_type_v2") + b").",
    }
    for why, pkl in refused.items():
        with pytest.raises(UnsafeCheckpoint, match="refused to load"):
            _load(h.archive(pkl, {"0": b"\x00" * 16}))
            pytest.fail(why)


def test_the_numpy_rng_state_is_admitted_only_whole():
    honest = np.random.RandomState(7).get_state()
    got = _load(h.saved({"rng": honest}))["rng"]
    assert got[0] == "MT19937" and (got[1] == honest[1]).all() and got[2:] == honest[2:]
    for bad in (("MT19937", honest[1], 625, 0, 0.0), ("MT19937", honest[1], 0, 2, 0.0),
                ("MT19937", honest[1], 0, 0, 1), ("PCG64", honest[1], 0, 0, 0.0),
                ("MT19937", honest[1][:623], 0, 0, 0.0)):
        with pytest.raises(UnsafeCheckpoint):
            _load(h.saved({"rng": bad}))


def test_nothing_outside_the_allowlist_is_resolved_or_called():
    for module, name in (("os", "system"), ("builtins", "eval"), ("builtins", "getattr"), ("torch", "load"),
                         ("torch", "Tensor"), ("torch", "empty"), ("torch.serialization", "_get_layout"),
                         ("numpy", "frombuffer"), ("numpy.random._pickle", "__randomstate_ctor"),
                         ("torch._utils", "_rebuild_device_tensor_from_numpy"), ("copyreg", "_reconstructor"),
                         ("torch", "Size.__new__"), ("collections", "OrderedDict.fromkeys")):
        with pytest.raises(UnsafeCheckpoint, match="is not in the allowlist"):
            _load(h.archive(h.PROTO + h.glob(module, name) + h.s("x") + b"\x85R."))
    for pkl in (h.PROTO + b"(" + h.glob("collections", "OrderedDict") + b"o.",  # OBJ
                h.PROTO + h.glob("collections", "OrderedDict") + b")}\x92.",  # NEWOBJ_EX
                h.PROTO + h.glob("collections", "OrderedDict") + b")\x81.",  # NEWOBJ
                h.PROTO + b"\x82\x01.", h.PROTO + b"P1\n."):  # EXT1, PERSID
        with pytest.raises(UnsafeCheckpoint, match="opcode"):
            _load(h.archive(pkl))


def _depth(obj) -> int:
    """Nesting depth, measured without recursion."""
    best, todo = 0, [(obj, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (list, tuple, set, frozenset)):
            best = max(best, d)
            todo += [(y, d + 1) for y in x]
        elif isinstance(x, dict):
            best = max(best, d)
            todo += [(y, d + 1) for kv in x.items() for y in kv]
    return best


def _count_leaves(obj) -> int:
    n, todo = 0, [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, tuple) and x:
            todo += list(x)
        else:
            n += 1
    return n


# ----------------------------------------------------------------- fuzz
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset,
          collections.OrderedDict, collections.Counter, torch.Size, torch.device, torch.dtype, torch.layout,
          torch.memory_format, torch.Tensor, torch.nn.Parameter, np.ndarray)


def _check_plain(obj, data_len: int) -> None:
    """Accepted input gives plain data only: allowlisted types, bounded depth, tensors
    within the bytes given, numpy arrays only as the RNG keys."""
    todo, seen = [(obj, 1)], 0
    while todo:
        x, d = todo.pop()
        seen += 1
        assert seen <= 4 * data_len + 100_000
        assert type(x) in _PLAIN, type(x)
        assert d <= trainstate.MAX_DEPTH + 1
        if isinstance(x, torch.Tensor):
            assert x.untyped_storage().nbytes() <= data_len
        elif isinstance(x, np.ndarray):
            assert x.dtype == np.uint32 and x.shape == (624,)
        elif isinstance(x, dict):
            todo += [(y, d + 1) for kv in x.items() for y in kv]
        elif isinstance(x, (list, tuple, set, frozenset)):
            todo += [(y, d + 1) for y in x]


def _outcome(data: bytes, kind: str) -> None:
    try:
        obj = _load(data)
    except CloudCkptError:
        _COUNTS[kind + " refused"] += 1
        return
    _COUNTS[kind + " accepted"] += 1
    _check_plain(obj, len(data))


HONEST_ARCHIVE = h.saved({"step": 3, "rng": np.random.RandomState(1).get_state(), "w": torch.arange(6.0)[1:],
                          "d": collections.OrderedDict(a=[1, 2.5, "x"], b=(None, True)), "s": {1, 2}})


@FUZZ
@given(st.binary(max_size=600))
def test_arbitrary_bytes_give_only_typed_errors(data):
    _outcome(data, "bytes")


@st.composite
def _edited(draw, base: bytes) -> bytes:
    """``base`` with one to six bytes flipped, runs inserted or bytes deleted."""
    buf = bytearray(base)
    edits = st.tuples(st.sampled_from("fid"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=8))
    for kind, at, payload in draw(st.lists(edits, min_size=1, max_size=6)):
        at %= len(buf)
        if kind == "f":
            buf[at] = payload[0]
        elif kind == "i":
            buf[at:at] = payload
        elif len(buf) > 2:
            del buf[at]
    return bytes(buf)


@FUZZ
@given(st.booleans(), st.data())
def test_mutated_honest_archives_give_only_typed_errors_or_plain_data(whole, data):
    """An honest archive with its file edited, or its pickle edited and zipped again."""
    if whole:
        _outcome(data.draw(_edited(HONEST_ARCHIVE)), "mutated archive")
    else:
        pkl = data.draw(_edited(h.records(HONEST_ARCHIVE)["data.pkl"]))
        _outcome(h.rezip(HONEST_ARCHIVE, replace={"data.pkl": pkl}), "mutated pickle")


_PIECES = [
    b"(", b"t", b"\x85", b"\x86", b"\x87", b")", b"]", b"a", b"e", b"}", b"s", b"u", b"\x8f", b"\x90", b"\x91",
    b"l", b"d", b"0", b"1", b"2", b"N", b"\x88", b"\x89", b"K\x07", b"J\xff\xff\xff\xff", b"\x8a\x09" + b"\xff" * 9,
    b"G?\xf0\x00\x00\x00\x00\x00\x00", b"X\x01\x00\x00\x00k", b"\x8c\x07MT19937", b"C\x02ab",
    b"q\x00", b"h\x00", b"q\x01", b"h\x01", b"\x94", b"R", b"b", b"Q",
    h.glob("__builtin__", "set"), h.glob("__builtin__", "bytearray"), h.glob("_codecs", "encode"),
    h.glob("collections", "OrderedDict"), h.glob("collections", "Counter"), h.glob("torch", "Size"),
    h.glob("torch", "device"), h.glob("torch", "FloatStorage"), h.glob("torch", "float32"),
    h.glob("torch._utils", "_rebuild_tensor_v2"), h.glob("torch._utils", "_rebuild_parameter"),
    h.glob("numpy._core.multiarray", "_reconstruct"), h.glob("numpy", "ndarray"), h.glob("numpy", "dtype"),
    h.glob("torch", "Tensor"), h.glob("os", "system"), h.s("storage"), h.s("0"), h.s("cpu"), h.s("latin1"),
    h.s("u4"), h.s("<"), b"\x93",
]


@FUZZ
@given(st.lists(st.sampled_from(_PIECES), max_size=60), st.binary(min_size=0, max_size=32))
def test_random_opcode_sequences_give_only_typed_errors_or_plain_data(pieces, storage):
    pkl = h.PROTO + b"".join(pieces) + b"."
    _outcome(h.archive(pkl, {"0": storage}), "opcode sequence")


@FUZZ
@given(st.integers(0, 7), st.integers(0, 12), st.lists(st.integers(0, 9), max_size=4),
       st.lists(st.integers(0, 9), max_size=4), st.sampled_from([0, 0, 0, 4, -4, 1]), st.booleans())
def test_crafted_tensor_fields_give_a_tensor_inside_its_storage_or_a_typed_error(offset, numel, size, stride, lie,
                                                                                  grad):
    """A float storage of ``numel`` elements (its record ``lie`` bytes off, mostly not)
    under a view of any offset, sizes and strides."""
    nbytes = max(0, 4 * numel + lie)
    try:
        t = _load(h.archive(h.tensor_pickle(offset=offset, numel=numel, size=tuple(size), stride=tuple(stride),
                                            requires_grad=grad), {"0": b"\x01" * nbytes}))
    except CloudCkptError:
        _COUNTS["tensor fields refused"] += 1
        return
    _COUNTS["tensor fields accepted"] += 1
    assert t.untyped_storage().nbytes() == nbytes
    if t.numel():
        last = t.storage_offset() + sum((d - 1) * s for d, s in zip(t.shape, t.stride(), strict=True))
        assert (last + 1) * 4 <= nbytes
        assert t.numel() * 4 <= nbytes
        assert t.sum().item() == pytest.approx(t.numel() * struct.unpack("<f", b"\x01" * 4)[0])


def test_fuzz_counts_are_reported(capsys):
    """Printed into CI's log (the counts go to stdout)."""
    with capsys.disabled():
        print(f"\ntrain-state fuzz examples per test: {EXAMPLES}; outcomes: {dict(sorted(_COUNTS.items()))}")
