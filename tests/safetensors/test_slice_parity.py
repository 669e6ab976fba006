"""``fastload.safe_open(path).get_slice(name)[index]`` against safetensors 0.8's, over every index
form safetensors accepts or refuses.

safetensors 0.8 (``framework="pt"``, its default mmap storage) indexes a torch view of the whole
stored tensor, so its answer is torch's: the tensor ``whole[index]`` (out-of-range slice bounds
clamped, ``None``, lists, tensors, numpy arrays, masks ...), or torch's exception (``IndexError``
for an int out of range or too many indices, ``ValueError`` for a step that is not positive,
``TypeError`` for a slice bound that is not an integer, ``RuntimeError`` ...). For every case
below fastload must give the identical tensor (values, shape, dtype), or raise an exception that
the same ``except`` clause catches, with safetensors' message in its own, as a
``fastload.SafetensorError``. The laziness (only the selected part of the file is read) is tested
at the end.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import safetensors.torch as st
import torch

import fastload
import safetensors

BIG = 2**63


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "f32_1d": torch.arange(6, dtype=torch.float32) - 2.5,
        "bf16_3d": (torch.arange(24, dtype=torch.float32) / 3).reshape(2, 3, 4).to(torch.bfloat16),
        "i32_3d": torch.arange(24, dtype=torch.int32).reshape(2, 3, 4) * 7 - 50,
        "f16_2d": (torch.arange(35, dtype=torch.float32) / 7).reshape(5, 7).to(torch.float16),
        "f64_0d": torch.tensor(7.25, dtype=torch.float64),
        "f32_zero": torch.zeros(2, 0, 3),
        "u8_zero_last": torch.zeros(3, 4, 0, dtype=torch.uint8),
    }


# Every form measured against safetensors 0.8.0 / torch 2.15 (each row is applied to every tensor
# above; a form that does not fit a shape checks that both refuse it alike).
INDICES: list[Any] = [
    # ints, negative from the end, out of range, past int64
    0,
    1,
    -1,
    2,
    5,
    6,
    -6,
    -7,
    BIG - 1,
    -BIG,
    2**64,
    np.int64(1),
    np.int32(-1),
    # slices: bounds clamped, steps (positive only), bounds past int64
    slice(None),
    slice(1, 4),
    slice(0, 100),
    slice(-100, 2),
    slice(BIG - 1, None),
    slice(2**64, None),
    slice(-BIG, None),
    slice(None, -BIG),
    slice(None, BIG),
    slice(-(2**64), None),
    slice(4, 2),
    slice(6, None),
    slice(7, None),
    slice(-1, None),
    slice(None, -1),
    slice(None, None, 2),
    slice(1, None, 3),
    slice(None, None, -1),
    slice(None, None, 0),
    slice(5, 1, -2),
    slice(None, None, BIG),
    slice(None, None, -BIG),
    slice(None, None, 2**62),
    slice(None, None, 2**61),
    slice(torch.tensor(1), torch.tensor(3)),
    slice(np.int64(1), 3),
    slice(1.0, 3),
    slice(None, None, True),
    slice("a", None),
    # Ellipsis
    ...,
    (..., ...),
    (..., 1),
    (1, ...),
    (1, ..., 1),
    (..., 1, ...),
    # None (a new dimension)
    None,
    (None,),
    (None, 1),
    (1, None),
    (None, ...),
    (..., None),
    (None, None),
    (None, 0, None, slice(1, 3), None),
    (0, ..., None, 1),
    (None, ..., None, ..., None),
    (None, ..., slice(1, 100)),
    # bools (a new dimension, kept or emptied)
    True,
    False,
    (True, 0),
    (False, 0),
    (1, True),
    (True, slice(None), [0, 1]),
    np.True_,
    # lists (and torch's rule for a short list holding sequences, slices, None or ...)
    [],
    [0, 2],
    [-1],
    [6],
    [1, 1, 0],
    [0, 1, 2, 1],
    [True, False, True, False, True, False],
    [True, False],
    [[0, 1], [2, 3]],
    [[0, 1], [1, 0]],
    [0, slice(None)],
    [None, 0],
    [..., 0],
    [0] * 33,
    [0] * 31 + [None],
    [np.int64(0), np.int64(1)],
    [np.int64(1), slice(None)],
    ([0, 1],),
    ([[0, 1], [1, 0]],),
    ((),),
    ((0, 1),),
    (0, (1, 2)),
    range(2),
    (slice(None), range(1, 3)),
    ([True, 2],),
    ([1, 2.0],),
    (0, [True, False, True]),
    (slice(None), [[True, False, True]]),
    ([[True, False, True], [True, True, True]],),
    # tuples mixing forms; more indices than dimensions; empty results
    (),
    (1,),
    (0, 0),
    (1, 2, 3),
    (1, 2, 4),
    (1, -3, -4),
    (1, 2, 3, 0),
    (0, 0, 0, 0),
    (0, 0, 0, None),
    (slice(None), 1),
    (slice(None), slice(None)),
    (slice(None), slice(None), slice(None), slice(None)),
    (slice(0, 100), slice(-100, 2), slice(BIG - 1, None)),
    (slice(None, None, 2), slice(None, None, 2), slice(1, None, 2)),
    (slice(None), slice(None), slice(None, None, -1)),
    (0, slice(None, None, 0)),
    (slice(None), [0, 2]),
    (slice(None), [0, 2], [1, 3]),
    ([0, 1], slice(None), [1, 3]),
    ([0, 1], 1, [1, 3]),
    ([0, 1], [1, 2, 0]),
    ([[0], [1]], [1, 2, 0]),
    (slice(None), [3]),
    (slice(2, None), [5]),
    (slice(2, None), [3]),
    (1, slice(None), [3]),
    (1, slice(0, 0), [5]),
    (slice(None), 5),
    (slice(1, 1), 5),
    (slice(1, 1), 0),
    (slice(None), slice(3, 3), [0, 1]),
    (1, slice(None, None, 2), [0, 3]),
    (slice(None, None, 2**60), slice(1, 2)),
    (slice(1, 2**62), 1),
    # torch tensors: ints, bools (masks), 0-d, wrong dtypes
    torch.tensor(2),
    torch.tensor(1, dtype=torch.uint8),
    torch.tensor(True),
    torch.tensor(False),
    torch.tensor([0, 2]),
    torch.tensor([1, 0], dtype=torch.int32),
    torch.tensor([1, 0], dtype=torch.uint8),
    torch.tensor([1, 0], dtype=torch.int8),
    torch.tensor([1.0]),
    torch.tensor([5]),
    torch.tensor([], dtype=torch.long),
    torch.tensor([[0, 1], [2, 0]]),
    torch.tensor([True, False]),
    torch.tensor([True, False, True]),
    torch.tensor([[True, False, True], [False, False, True]]),
    (torch.tensor(1), torch.tensor(2)),
    (torch.tensor(1), slice(None), [0, 1]),
    (slice(None), torch.tensor([0, 2]), slice(1, 3)),
    (torch.tensor([1, 0]), slice(None), torch.tensor([[0], [3]])),
    (torch.tensor([1, 0]), ..., torch.tensor([[0], [3]])),
    (slice(None), torch.tensor([[True, False, True, False]] * 3)),
    # numpy arrays
    np.array([0, 2]),
    np.array([True, False]),
    np.array([[0, 1], [1, 0]]),
    np.array(2),
    np.array(True),
    np.array([1, 0], dtype=np.uint8),
    np.array([1.5]),
    (slice(None), np.array([2, 0])),
    (slice(None), np.array(1), [0, 1]),
    (np.array([[True, False, True], [True, True, True]]),),
    # what torch refuses outright
    1.0,
    "a",
    b"\x00",
    bytearray(b"\x01"),
    {0},
    {0: 1},
    object(),
    (0, 1.5),
]


def _short(item: Any) -> str:
    if isinstance(item, slice):
        parts = ["" if v is None else _short(v) for v in (item.start, item.stop)]
        return ":".join(parts) + ("" if item.step is None else f":{_short(item.step)}")
    if item is Ellipsis:
        return "..."
    if isinstance(item, torch.Tensor):
        return f"T{item.tolist()}{str(item.dtype)[6:]}".replace(" ", "")
    if isinstance(item, np.ndarray):
        return f"A{item.tolist()}{item.dtype}".replace(" ", "")
    if isinstance(item, np.generic):
        return f"np.{type(item).__name__}({item})"
    if isinstance(item, int) and not isinstance(item, bool) and abs(item) >= 2**60:
        size, sign = abs(item), "-" if item < 0 else ""
        if size & (size - 1) == 0:
            return f"{sign}2**{size.bit_length() - 1}"
        return f"{sign}(2**{size.bit_length()}-1)" if (size + 1) & size == 0 else repr(item)
    if isinstance(item, tuple):
        return "(" + ",".join(_short(i) for i in item) + ("," if len(item) == 1 else "") + ")"
    if isinstance(item, list):
        text = ",".join(_short(i) for i in item)
        return f"[{text}]" if len(text) < 60 else f"[{len(item)} items]"
    if type(item) is object:
        return "object()"
    if isinstance(item, type):
        return item.__name__
    return repr(item).replace(" ", "")


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    file = tmp_path_factory.mktemp("slices") / "slices.safetensors"
    st.save_file(_tensors(), str(file))
    return str(file)


@pytest.fixture(scope="module")
def handles(path: str) -> Iterator[tuple[Any, Any]]:
    with fastload.safe_open(path) as ours, safetensors.safe_open(path, framework="pt") as theirs:
        yield ours, theirs


def _outcome(call: Callable[[], torch.Tensor]) -> torch.Tensor | Exception:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation/truncation warnings, both sides
        try:
            return call()
        except Exception as exc:
            return exc


def assert_same_outcome(ours: torch.Tensor | Exception, theirs: torch.Tensor | Exception) -> None:
    """Identical tensors, or an exception of ours that ``except type(theirs)`` catches, is a
    ``fastload.SafetensorError`` (or the very class) and carries safetensors' message."""
    if isinstance(theirs, Exception):
        assert isinstance(ours, Exception), f"safetensors raises {theirs!r}, fastload: {ours}"
        assert isinstance(ours, type(theirs)), f"{ours!r} is not caught like {theirs!r}"
        assert type(ours) is type(theirs) or isinstance(ours, fastload.SafetensorError), repr(ours)
        assert str(theirs) in str(ours), f"{ours} does not carry {theirs}"
        return
    assert not isinstance(ours, Exception), f"fastload raises {ours!r}, safetensors returns"
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert ours.device == theirs.device
    assert torch.equal(ours, theirs), f"{ours} != {theirs}"


@pytest.mark.parametrize("index", INDICES, ids=_short)
@pytest.mark.parametrize("name", list(_tensors()))
def test_get_slice_index_equals_safetensors(handles, name: str, index: Any) -> None:
    ours, theirs = handles
    assert_same_outcome(
        _outcome(lambda: ours.get_slice(name)[index]),
        _outcome(lambda: theirs.get_slice(name)[index]),
    )


def test_safetensors_answers_as_torch_does_on_the_whole_tensor(handles) -> None:
    """The reference itself: safetensors 0.8's get_slice is torch's indexing of the whole tensor
    (if this fails, a new safetensors changed its semantics and the table needs a new look)."""
    _, theirs = handles
    for name, whole in _tensors().items():
        for index in INDICES:
            assert_same_outcome(
                _outcome(lambda: theirs.get_slice(name)[index]),  # noqa: B023
                _outcome(lambda: whole[index]),  # noqa: B023
            )


# --- the exception classes, as written for safetensors and for fastload ---


@pytest.mark.parametrize(
    ("index", "builtin"),
    [
        (6, IndexError),
        ((0, 0, 0), IndexError),
        (([6],), IndexError),
        (torch.tensor([True]), IndexError),
        (1.0, IndexError),
        (slice(None, None, -1), ValueError),
        (slice(None, None, 0), ValueError),
        (slice(1.0, 3), TypeError),
        ([0] * 31 + [None], RuntimeError),
    ],
    ids=_short,
)
def test_a_refused_index_is_the_builtin_and_a_fastload_error(handles, index, builtin) -> None:
    ours, _ = handles
    with pytest.raises(builtin) as info:
        ours.get_slice("f16_2d")[index]
    assert isinstance(info.value, fastload.SafetensorError)
    assert isinstance(info.value, fastload.RequestError)
    assert "f16_2d" in str(info.value) and "[5, 7]" in str(info.value)


# --- laziness: only the covering part of the file is read ---


@pytest.fixture
def counted(path: str, monkeypatch) -> Iterator[tuple[Any, list[int]]]:
    """A handle whose fills record the elements they read (-1 for a whole-tensor fill)."""
    read: list[int] = []
    with fastload.safe_open(path) as f:
        original = f.fill

        def counting(items):
            items = list(items)
            read.extend(dest.numel() for _, dest, _ in items)
            return original(items)

        monkeypatch.setattr(f, "fill", counting)
        yield f, read


# f16_2d is [5, 7]: a row is 7 elements, a column 5.
LAZY = [
    ((slice(None), 3), 5),
    (2, 7),
    ((None, slice(1, 3)), 14),
    ((..., 6), 5),
    (slice(0, 100), 35),
    (slice(-100, 2), 14),
    (slice(1, 5, 3), 28),  # rows 1 and 4: the covering rows 1..4
    ([4, 1, 2], 28),  # rows 1..4
    ((slice(None), [6, 4]), 15),  # columns 4..6
    (torch.tensor([3]), 7),
    (np.array([-1]), 7),
    ((slice(None), torch.tensor([False, False, True, False, False, True, False])), 20),
    ((0, [True, False, True, False, False, False, False]), 7),  # the row is the narrower cover
    (None, 35),
    (True, 35),
    ((), 35),
]


@pytest.mark.parametrize(("index", "elements"), LAZY, ids=_short)
def test_a_selection_reads_only_its_covering_range(counted, index, elements) -> None:
    f, read = counted
    got = f.get_slice("f16_2d")[index]
    assert read == [elements]
    assert torch.equal(got, _tensors()["f16_2d"][index])


@pytest.mark.parametrize(
    "index",
    [
        slice(BIG - 1, None),
        slice(4, 2),
        (slice(None), []),
        False,
        torch.tensor([], dtype=torch.int64),
    ],
    ids=_short,
)
def test_an_empty_selection_reads_nothing(counted, index) -> None:
    f, read = counted
    got = f.get_slice("f16_2d")[index]
    assert read == [] and got.shape == _tensors()["f16_2d"][index].shape


@pytest.mark.parametrize(
    "index",
    [5, (slice(None), 7), (0, 0, 0), slice(None, None, -1), ([5],), torch.tensor([9]), 1.0],
    ids=_short,
)
def test_a_refused_index_reads_nothing(counted, index) -> None:
    f, read = counted
    with pytest.raises(fastload.SafetensorError):
        f.get_slice("f16_2d")[index]
    assert read == []


def test_a_selected_part_does_not_keep_the_block_alive(handles) -> None:
    ours, _ = handles
    row = ours.get_slice("f16_2d")[(slice(None), [1, 5])]
    assert row.untyped_storage().nbytes() == row.numel() * row.element_size()
    col = ours.get_slice("i32_3d")[(slice(None), 1, slice(None, None, 2))]
    assert col.is_contiguous()
    assert col.untyped_storage().nbytes() == col.numel() * col.element_size()


# --- a device: safetensors indexes on the CPU and moves the result ---


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "index",
    [(slice(None), 1), slice(0, 100), None, [1, 0], (slice(None), torch.tensor([2, 0])), 7],
    ids=_short,
)
def test_get_slice_on_cuda_equals_safetensors(path, index) -> None:
    with (
        fastload.safe_open(path, device="cuda:0") as ours,
        safetensors.safe_open(path, framework="pt", device="cuda:0") as theirs,
    ):
        for name in ("bf16_3d", "f16_2d"):
            assert_same_outcome(
                _outcome(lambda: ours.get_slice(name)[index]),  # noqa: B023
                _outcome(lambda: theirs.get_slice(name)[index]),  # noqa: B023
            )


# --- the one deliberate difference: packed F4 ---


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch without float4")
@pytest.mark.parametrize("index", [slice(None), 1, (slice(None), 0), None, (..., slice(1, 9))])
def test_f4_slices_index_the_packed_torch_tensor(tmp_path, index) -> None:
    """safetensors 0.8 refuses every index of an F4 tensor (its reshape to the header's shape of
    4-bit values fails: RuntimeError); fastload indexes torch's packed view, as get_tensor gives
    it (a [2, 4] F4 tensor is a [2, 2] float4_e2m1fn_x2 tensor)."""
    packed = torch.arange(4, dtype=torch.uint8).reshape(2, 2).view(torch.float4_e2m1fn_x2)
    file = str(tmp_path / "f4.safetensors")
    st.save_file({"f": packed}, file)
    with fastload.safe_open(file) as ours, safetensors.safe_open(file, framework="pt") as theirs:
        with pytest.raises(RuntimeError):
            theirs.get_slice("f")[index]
        got = ours.get_slice("f")[index]
        want = ours.get_tensor("f")[index]
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
