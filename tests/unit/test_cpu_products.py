"""The CPU library's matrix products (engines/cpu_products.py): the 1-8 row kernel and
the packed-weight kernels (AMX, panels) against float64, their packings, their
first-use checks, and the model's products reaching them with torch's tokens."""
from __future__ import annotations

import pytest
import torch

import engines.cpu_products as cp
from engines.loader import load_model
from engines.offline import OfflineEngine
from tests.unit.cpu_support import cpu_has, require_compiler

require_compiler()


def _greedy_tokens(model, prompts: list[list[int]]) -> list[list[int]]:
    """Eight greedy tokens for each prompt, decoded together."""
    from engines.request import Request
    from engines.sampler import SamplingParams
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    outs = OfflineEngine(model).run([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return [o["output_ids"] for o in outs]


# float32 sums: float32's rounding; bfloat16: then one rounding to bfloat16 (2^-8 relative)
@pytest.mark.parametrize("dtype,flag,tol", [(torch.float32, "avx512f", 1e-5), (torch.bfloat16, "avx512_bf16", 2 ** -8)])
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("n,k", [(40, 64), (13, 70), (1, 31), (576, 1536), (3072, 576)])
def test_small_products_equal_float64(dtype, flag, tol, rows, n, k):
    """1-8 rows; weight rows in and out of the kernel's blocks, lengths in and out of
    its vector steps."""
    kernel = cp.small_linear(dtype)
    if not cpu_has(flag):
        assert kernel is None                      # the CPU lacks the instructions
        return
    g = torch.Generator().manual_seed(n * k + rows)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    x, b = torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    for bias in (None, b):
        want = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = kernel(x, w, bias)
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=1e-3 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_small_products_go_to_the_kernel(monkeypatch, batch, dtype):
    """The model's products of up to 8 rows call the kernel (where the CPU has it; in
    bfloat16 where the AMX kernel does not take them), and decode steps give the
    tokens torch's products give."""
    from engines.linear import PACKED
    if cp.small_linear(dtype) is None:
        assert not cpu_has("avx512f" if dtype == torch.float32 else "avx512_bf16")
        return
    monkeypatch.setattr(cp, "packed_linear", lambda dtype: None)
    PACKED.configure(True)                                   # forget the AMX packing
    monkeypatch.setattr(PACKED, "_usable", {})
    calls = []
    real = cp.SmallLinear.__call__
    monkeypatch.setattr(cp.SmallLinear, "__call__", lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    model = load_model("tiny", dtype=str(dtype).removeprefix("torch."))
    prompts = [[5, 6, 7], [9, 8], [1, 2, 3, 4]][:batch]
    with_kernel = _greedy_tokens(model, prompts)
    assert calls.count(batch) >= 7 * len(model.net.linears())    # 7 decode steps of `batch` rows
    monkeypatch.setattr(cp, "small_linear", lambda dtype: None)
    assert _greedy_tokens(model, prompts) == with_kernel
    assert PACKED.usable(dtype) is not None              # more rows still packed


def _packed_kernel_expected(dtype) -> bool:
    return cpu_has("avx512_bf16" if dtype == torch.bfloat16 else "avx512f")


def _kind(dtype):
    """The packed kernel this CPU should get: bfloat16 on AMX where it has it, else in
    AVX512-BF16 panels; float32 in panels."""
    if dtype == torch.float32:
        return cp.PanelLinear
    return cp.AmxLinear if all(cpu_has(f) for f in ("amx_bf16", "amx_tile")) else cp.BPanelLinear


# panels sum each output in one float32 chain over K (1,536 terms here): 1e-4
PACKED_KINDS = [(torch.bfloat16, _kind(torch.bfloat16), 2 ** -8, 1e-3), (torch.float32, cp.PanelLinear, 1e-4, 1e-4)]


@pytest.mark.parametrize("dtype,kind,rtol,atol", PACKED_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 8, 15, 16, 17, 31, 32, 33, 49, 64, 65, 100, 203, 256])
@pytest.mark.parametrize("n,k", [(40, 64), (13, 96), (1, 32), (80, 48), (576, 1536), (960, 576)])
def test_packed_products_equal_float64(dtype, kind, rtol, atol, rows, n, k):
    """Rows within, at and across the kernels' blocks (16 and 32 rows on AMX; 24 rows
    of x transposed, or past 64 rows 8 rows of x as it is, in panels); outputs short
    of, at and past their blocks, panels in passes of 3, 2 and 1; with and without a
    bias."""
    kernel = cp.packed_linear(dtype)
    if not _packed_kernel_expected(dtype):
        assert kernel is None
        return
    assert isinstance(kernel, kind)
    g = torch.Generator().manual_seed(n * k + rows)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    x, b = torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    packed = kernel.pack(w)
    assert packed.numel() == -(-n // kind.BLOCK) * kind.BLOCK * k
    for bias in (None, b):
        want = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = kernel(x, packed, n, bias)
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


def test_pack_layouts():
    """AMX: element [b, s, h, r, n, j] is w[32 b + 16 h + n, 32 s + 2 r + j]; panels:
    element [p, k, n] is w[16 p + n, k]; bfloat16 panels: element [p, s, n, j] is
    w[16 p + n, 2 s + j]; the rows that pad N are zero."""
    w = torch.arange(40 * 64, dtype=torch.float32).view(40, 64)
    packed = cp.AmxLinear.layout(w.to(torch.bfloat16))
    assert packed.shape == (2, 2, 2, 16, 16, 2)
    for b, s, h, r, n, j in [(0, 0, 0, 0, 0, 0), (0, 1, 1, 3, 5, 1), (1, 0, 0, 15, 7, 0), (0, 1, 1, 15, 15, 1)]:
        assert packed[b, s, h, r, n, j] == w.to(torch.bfloat16)[32 * b + 16 * h + n, 32 * s + 2 * r + j]
    assert not packed[1, :, :, :, 8:].any() and not packed[1, :, 1].any()
    panels = cp.PanelLinear.layout(w)
    assert panels.shape == (3, 64, 16)
    for p, k, n in [(0, 0, 0), (1, 5, 9), (2, 63, 7)]:
        assert panels[p, k, n] == w[16 * p + n, k]
    assert not panels[2, :, 8:].any()
    pairs = cp.BPanelLinear.layout(w.to(torch.bfloat16))
    assert pairs.shape == (3, 32, 16, 2)
    for p, s, n, j in [(0, 0, 0, 0), (1, 5, 9, 1), (2, 31, 7, 1)]:
        assert pairs[p, s, n, j] == w.to(torch.bfloat16)[16 * p + n, 2 * s + j]
    assert not pairs[2, :, 8:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(1, 32), (13, 96), (40, 64), (960, 576), (576, 1536)])
def test_the_librarys_packing_is_the_layout(dtype, n, k):
    """`pack` (C++, threads) writes exactly `layout` (torch), padding rows included,
    from row-major and column-major weights."""
    kernel = cp.packed_linear(dtype)
    if kernel is None:
        assert not _packed_kernel_expected(dtype)
        return
    w = torch.randn(n, k).to(dtype)
    assert torch.equal(kernel.pack(w), kernel.layout(w).view(-1))
    assert torch.equal(kernel.pack(w.t().contiguous().t()), kernel.layout(w).view(-1))


def test_packed_kernels_refuse_bad_shapes():
    for dtype in (torch.bfloat16, torch.float32):
        kernel = cp.packed_linear(dtype)
        if kernel is None:
            assert not _packed_kernel_expected(dtype)
            continue
        w = torch.randn(8, 64).to(dtype)
        with pytest.raises(AssertionError):                      # a packing of another size
            kernel(torch.randn(2, 64).to(dtype), kernel.pack(w)[:1], 40)
        with pytest.raises(AssertionError):                      # another dtype
            kernel(torch.randn(2, 64).double(), kernel.pack(w), 8)
    bf16 = cp.packed_linear(torch.bfloat16)
    if bf16 is not None:             # AMX: K a multiple of 32; bfloat16 panels: K even
        k = 48 if isinstance(bf16, cp.AmxLinear) else 47
        with pytest.raises(AssertionError):
            bf16(torch.randn(2, k).to(torch.bfloat16), torch.zeros(32 * k, dtype=torch.bfloat16), 8)
    w = torch.randn(8, 64)
    assert not cp.AmxLinear.fits(torch.randn(8, 48).to(torch.bfloat16)) and not cp.AmxLinear.fits(w)
    assert cp.AmxLinear.fits(w.to(torch.bfloat16)) and cp.PanelLinear.fits(torch.randn(8, 48))
    assert cp.BPanelLinear.fits(torch.randn(8, 46).to(torch.bfloat16))
    assert not cp.BPanelLinear.fits(torch.randn(8, 47).to(torch.bfloat16)) and not cp.BPanelLinear.fits(w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_wrong_packed_kernel_is_not_used(monkeypatch, caplog, dtype):
    """A packing in the wrong layout (here: its last two dimensions swapped) is caught
    by the first-use check against float64."""
    kind = _kind(dtype)
    if cp.packed_linear(dtype) is None:
        assert not _packed_kernel_expected(dtype)
        return
    right = kind.layout
    wrong = staticmethod(lambda w: right(w).transpose(-1, -2).contiguous())
    _refused(monkeypatch, caplog, dtype, kind, f"{kind.__name__} product kernel disagrees",
             layout=wrong, pack=lambda self, w: wrong(w).view(-1))


@pytest.mark.parametrize("dtype,batch", [(torch.bfloat16, 1), (torch.bfloat16, 3), (torch.bfloat16, 10),
                                         (torch.float32, 10)])
def test_model_products_go_to_the_packed_kernels(monkeypatch, dtype, batch):
    """The model's decode products go to the packed-weight kernel: in bfloat16 on AMX
    at every batch, none to the dot-product kernel or oneDNN; in float32 and in
    bfloat16 panels past 8 rows (the dot-product kernel below); and they give the
    tokens torch's products give."""
    from engines.linear import PACKED
    kernel = cp.packed_linear(dtype)
    if kernel is None:
        assert not _packed_kernel_expected(dtype)
        return
    calls, small = [], []
    real = type(kernel).__call__
    monkeypatch.setattr(type(kernel), "__call__", lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    real_small = cp.SmallLinear.__call__
    monkeypatch.setattr(cp.SmallLinear, "__call__",
                        lambda self, x, *a: small.append(x.shape[0]) or real_small(self, x, *a))
    PACKED.configure(True)
    model = load_model("tiny", dtype=str(dtype).removeprefix("torch."))
    prompts = [[5 + i, 6, 7 + i % 3] for i in range(batch)]
    with_kernel = _greedy_tokens(model, prompts)
    if isinstance(kernel, cp.AmxLinear) or batch > cp.SmallLinear.ROWS:
        assert calls.count(batch) >= 7 * len(model.net.linears()) and batch not in small
    else:
        assert small.count(batch) >= 7 * len(model.net.linears()) and batch not in calls
    assert PACKED.usable(dtype).name == type(kernel).__name__
    monkeypatch.setattr(PACKED, "enabled", False)
    monkeypatch.setattr(PACKED, "_usable", {})
    monkeypatch.setattr(cp, "small_linear", lambda dtype: None)
    assert _greedy_tokens(model, prompts) == with_kernel
    PACKED.configure(True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_packing_that_is_not_its_layout_is_not_used(monkeypatch, caplog, dtype):
    kind = _kind(dtype)
    if cp.packed_linear(dtype) is None:
        assert not _packed_kernel_expected(dtype)
        return
    _refused(monkeypatch, caplog, dtype, kind, f"{kind.__name__} packing is not its layout",
             pack=lambda self, w: torch.zeros_like(kind.layout(w).view(-1)))


def _refused(monkeypatch, caplog, dtype, kind, message: str, **broken) -> None:
    """With `broken` attributes on the kernel class, the first-use check refuses it
    (packed_linear gives another kind or None, logging `message`); with them gone, it
    is taken again."""
    for name, value in broken.items():
        monkeypatch.setattr(kind, name, value)
    cp.packed_linear.cache_clear()
    try:
        assert not isinstance(cp.packed_linear(dtype), kind)
        assert message in caplog.text
    finally:
        monkeypatch.undo()
        cp.packed_linear.cache_clear()
    assert isinstance(cp.packed_linear(dtype), kind)


def test_a_kernel_missing_from_the_library_is_skipped(monkeypatch, caplog):
    """A packed kind whose entry point the library lacks is logged and passed over:
    bfloat16 goes on to its panels (where the CPU has AVX512-BF16), float32 to torch's
    products (None)."""
    if cp.packed_linear(torch.float32) is None:
        assert not _packed_kernel_expected(torch.float32)
        return
    for kind in (cp.AmxLinear, cp.PanelLinear):
        monkeypatch.setattr(kind, "SYMBOL", "zpd_no_such_kernel")
    cp.packed_linear.cache_clear()
    try:
        assert cp.packed_linear(torch.float32) is None
        got = cp.packed_linear(torch.bfloat16)
        assert isinstance(got, cp.BPanelLinear) if _packed_kernel_expected(torch.bfloat16) else got is None
        assert "AmxLinear packed product kernel unavailable" in caplog.text
    finally:
        monkeypatch.undo()
        cp.packed_linear.cache_clear()
    assert isinstance(cp.packed_linear(torch.float32), cp.PanelLinear)
