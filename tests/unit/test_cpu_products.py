"""The CPU library's matrix products (engines/cpu/products.py): the 1-8 row kernel and
the packed-weight kernels (AMX, panels) against float64, their packings, their
first-use checks, and the model's products reaching them with torch's tokens."""
from __future__ import annotations

import pytest
import torch

import engines.cpu.products as cp
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
    from engines.cpu.linear import PackedWeights
    if cp.small_linear(dtype) is None:
        assert not cpu_has("avx512f" if dtype == torch.float32 else "avx512_bf16")
        return
    monkeypatch.setattr(cp, "packed_linear", lambda dtype: None)   # no AMX packing
    calls = []
    real = cp.SmallLinear.__call__
    monkeypatch.setattr(cp.SmallLinear, "__call__", lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    model = load_model("tiny", dtype=str(dtype).removeprefix("torch."))
    prompts = [[5, 6, 7], [9, 8], [1, 2, 3, 4]][:batch]
    with_kernel = _greedy_tokens(model, prompts)
    assert calls.count(batch) >= 7 * len(model.net.linears())    # 7 decode steps of `batch` rows
    monkeypatch.setattr(cp, "small_linear", lambda dtype: None)
    assert _greedy_tokens(model, prompts) == with_kernel
    assert PackedWeights().usable(dtype) is not None     # more rows still packed


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
    if not kernel.fits(w):        # AMX tiles need K a multiple of 32: such weights stay torch's
        assert isinstance(kernel, cp.AmxLinear) and k % 32 != 0
        return
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
    from engines.cpu.kernels import SETTINGS
    from engines.cpu.linear import PackedWeights
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
    model = load_model("tiny", dtype=str(dtype).removeprefix("torch."))
    prompts = [[5 + i, 6, 7 + i % 3] for i in range(batch)]
    with_kernel = _greedy_tokens(model, prompts)
    if isinstance(kernel, cp.AmxLinear) or batch > cp.SmallLinear.ROWS:
        assert calls.count(batch) >= 7 * len(model.net.linears()) and batch not in small
    else:
        assert small.count(batch) >= 7 * len(model.net.linears()) and batch not in calls
    assert PackedWeights().usable(dtype).name == type(kernel).__name__
    monkeypatch.setattr(SETTINGS, "packed_weights", False)     # the next engine's backend
    monkeypatch.setattr(cp, "small_linear", lambda dtype: None)
    assert _greedy_tokens(model, prompts) == with_kernel


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 65, 203])
@pytest.mark.parametrize("n,k", [(64, 32), (192, 96), (3072, 576)])
def test_gated_products_are_silu_mul_of_the_product(dtype, rows, n, k):
    """SiLU(gate) * up in the panel kernels' product is bit for bit what silu_mul makes
    of the product (so a prompt's tokens do not depend on which ran), and float64's to
    the dtype's rounding; passes of every row count up to and past their 6 rows, with
    and without a bias. Kernels without it (AMX) have none."""
    from engines.cpu.layer_ops import layer_ops
    kernel = cp.packed_linear(dtype)
    if kernel is None or isinstance(kernel, cp.AmxLinear):
        assert kernel is not None or not _packed_kernel_expected(dtype)
        assert kernel is None or kernel.gated_fn is None
        return
    assert kernel.gated_fn is not None
    g = torch.Generator().manual_seed(n + k + rows)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    x, b = torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    packed, ops = kernel.pack(w), layer_ops(dtype, "cpu")
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for bias in (None, b):
        got = kernel.gated(x, packed, n, bias)
        assert got.dtype == dtype and got.shape == (rows, n // 2)
        assert torch.equal(got, ops.silu_mul(kernel(x, packed, n, bias)))
        torch.testing.assert_close(got.double(), cp.gated_reference(x, w, bias), **tol)


def test_gated_products_refuse_what_they_cannot_pair():
    """The library refuses a [gate; up] weight whose halves are not whole pairs of
    panels; `gated_linear` leaves such weights and decode-sized inputs to the product
    and silu_mul."""
    from engines.cpu.linear import GATED_MIN_ROWS, PackedWeights
    weights = PackedWeights()
    gated_linear = weights.gated_linear
    kernel = cp.packed_linear(torch.float32)
    if kernel is None:
        assert not _packed_kernel_expected(torch.float32)
        return
    w, x = torch.randn(96, 32), torch.randn(70, 32)
    packed, y = kernel.pack(w), torch.empty(70, 48)
    status = kernel.gated_fn(x.data_ptr(), packed.data_ptr(), None, y.data_ptr(), 70, 96, 32, 1)
    assert cp.describe(status) == "bad shape"
    assert gated_linear(x, w) is None
    assert gated_linear(torch.randn(GATED_MIN_ROWS, 32), torch.randn(128, 32)) is None
    wide = gated_linear(torch.randn(GATED_MIN_ROWS + 1, 32), torch.randn(128, 32))
    assert (wide is not None) == (weights.usable(torch.float32).rows[1] > GATED_MIN_ROWS)  # not on Intel


def test_a_wrong_gated_kernel_is_not_used(monkeypatch, caplog):
    """A gated kernel that gives something else (here zeros) fails the first-use check:
    the kernel is kept for products, without `gated`."""
    kind = _kind(torch.bfloat16) if cp.packed_linear(torch.float32) is None else cp.PanelLinear
    if cp.packed_linear(kind.DTYPE) is None or kind.GATED_SYMBOL is None:
        assert not _packed_kernel_expected(kind.DTYPE) or kind is cp.AmxLinear
        return
    monkeypatch.setattr(kind, "gated", lambda self, x, p, n, b=None: x.new_zeros(x.shape[0], n // 2))
    cp.packed_linear.cache_clear()
    try:
        kernel = cp.packed_linear(kind.DTYPE)
        assert isinstance(kernel, kind) and kernel.gated_fn is None
        assert "SiLU(gate) * up disagrees with float64" in caplog.text
    finally:
        monkeypatch.undo()
        cp.packed_linear.cache_clear()
    assert cp.packed_linear(kind.DTYPE).gated_fn is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefills_take_silu_mul_in_the_product_where_the_kernel_does(monkeypatch, dtype):
    """A prompt past 64 tokens runs its MLPs' gate and up through `gated` wherever the
    packing of its dtype has it and covers those rows (panels; not AMX, not float32 past
    64 rows on Intel, where MKL multiplies), and its tokens are those of the product
    followed by silu_mul."""
    from engines.cpu.linear import PackedWeights
    model = load_model("tiny", dtype=str(dtype).removeprefix("torch."))
    prompt = [[(7 * i) % 200 + 3 for i in range(100)]]
    packing = PackedWeights().usable(dtype)
    expected = packing is not None and packing.gated is not None and packing.rows[1] > 100
    kernel, calls = cp.packed_linear(dtype), []
    if kernel is not None:
        real = type(kernel).gated
        monkeypatch.setattr(type(kernel), "gated", lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    fused = _greedy_tokens(model, prompt)
    # every layer but the last, whose MLP runs the prompt's last token only (LastTokens)
    assert (calls == [100] * (len(model.net.model.layers) - 1)) == expected and (expected or not calls)
    monkeypatch.setattr(PackedWeights, "gated_linear", lambda self, x, w: None)
    assert _greedy_tokens(model, prompt) == fused
