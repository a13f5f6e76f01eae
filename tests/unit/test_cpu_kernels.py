"""The CPU kernels (engines/cpu_kernels.py): decode attention against a float64
reference and torch's path, its refusal of rows outside the pool, the bfloat16
one-row product against float64, and how the library is built, cached and given up
on."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

import engines.cpu_kernels as pd
from engines.loader import load_model
from engines.offline import OfflineEngine

# CI installs a compiler (scripts/install.sh): there a missing kernel is a failure
if shutil.which(os.environ.get("CXX") or "g++") is None and not os.environ.get("CI"):
    pytest.skip("no C++ compiler to build the kernel with", allow_module_level=True)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The kernel looked up again under the test's settings (built in a cache of its
    own), and the default settings back after."""
    pd.configure(True, tmp_path / "kernels")
    yield monkeypatch
    monkeypatch.undo()
    pd.configure()


def kernel() -> pd.PagedDecode:
    k = pd.kernel_for(torch.float32, "cpu")
    assert k is not None, "the kernel did not build or load"
    return k


def _case(dtype, batch, q_heads, kv_heads, head_dim, lengths, pool_rows=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(pool_rows, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(dtype)
    width = max(lengths)
    rows = torch.randint(0, pool_rows, (batch, width), generator=g)
    return q, k, v, rows, torch.tensor(lengths)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (16, 2, 128), (8, 1, 80)])
def test_kernel_equals_float64_attention(dtype, tol, q_heads, kv_heads, head_dim):
    lengths = [1, 17, 300, 2, 64, 129, 33]
    q, k, v, rows, lens = _case(dtype, len(lengths), q_heads, kv_heads, head_dim, lengths)
    got = kernel()(q, k, v, rows, lens, head_dim ** -0.5)
    want = pd.reference(q, k, v, rows, lens, head_dim ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_a_sequence_reads_only_its_own_length():
    """Rows past a sequence's length are not read: pointing them elsewhere changes nothing."""
    q, k, v, rows, lens = _case(torch.float32, 3, 6, 2, 32, [5, 40, 12])
    before = kernel()(q, k, v, rows, lens, 0.2)
    rows[0, 5:], rows[2, 12:] = 0, 499
    torch.testing.assert_close(kernel()(q, k, v, rows, lens, 0.2), before, rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["row below the pool", "row past the pool", "length past the table",
                                 "empty context"])
def test_rows_outside_the_pool_raise_instead_of_reading(bad):
    q, k, v, rows, lens = _case(torch.float32, 2, 6, 2, 32, [10, 20], pool_rows=100)
    if bad == "row below the pool":
        rows[1, 19] = -1
    elif bad == "row past the pool":
        rows[0, 3] = 100
    elif bad == "length past the table":
        lens[0] = 21
    else:
        lens[1] = 0
    with pytest.raises(RuntimeError, match="decode attention kernel"):
        kernel()(q, k, v, rows, lens, 0.2)
    q, k, v, rows, lens = _case(torch.float32, 2, 6, 2, 32, [10, 20], pool_rows=100)
    rows[0, 15] = 10 ** 9              # past its sequence's length, so never read: accepted
    kernel()(q, k, v, rows, lens, 0.2)


# bfloat16: torch's attention rounds its scores and probabilities to bfloat16 and the
# kernel does not, so logits differ by up to ~0.07 (a wrong row read would be ~1)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.15)])
def test_engine_decode_with_the_kernel_equals_torch_attention(dtype, tol):
    """A decode step over contexts of different lengths (three of torch's length
    groups) gives the same logits with the kernel as with torch's attention, and the
    runner uses the kernel for CPU float32 and bfloat16 pools."""
    model = load_model("tiny", dtype=str(dtype).removeprefix("torch."))
    engine = OfflineEngine(model, max_batch=3)
    runner, pool = engine.compute.runner, engine.compute.pool
    assert runner.kernel is not None
    lengths = [3, 300, 40]
    tables = [pool.allocator.alloc(pool.pages_for(n + 1)) for n in lengths]
    runner.prefill([[(7 * n + i) % 200 + 1 for i in range(n)] for n in lengths], tables)
    with_kernel = runner.decode([5, 6, 7], lengths, tables).double()
    runner.kernel = None
    with_torch = runner.decode([5, 6, 7], lengths, tables).double()
    torch.testing.assert_close(with_kernel, with_torch, rtol=0, atol=tol)


def test_float64_and_other_devices_use_torch_attention():
    assert pd.kernel_for(torch.float64, "cpu") is None
    assert pd.kernel_for(torch.float32, "cuda") is None
    assert OfflineEngine(load_model("tiny", dtype="float64")).compute.runner.kernel is None


def test_built_once_then_loaded_from_the_cache(fresh, tmp_path):
    pd.load()
    (path,) = (tmp_path / "kernels").iterdir()
    assert path.parent == tmp_path / "kernels" and path.exists()
    assert oct((tmp_path / "kernels").stat().st_mode & 0o777) == "0o700"

    def no_compiling(*a):
        raise AssertionError("compiled again")
    fresh.setattr(pd, "_compile", no_compiling)
    assert pd.build(tmp_path / "kernels") == path
    assert pd.kernel_for(torch.bfloat16, "cpu") is not None


def test_a_cache_others_can_write_to_is_not_used(fresh, tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    pd.configure(True, shared)
    built, real = [], pd.build
    fresh.setattr(pd, "build", lambda directory: built.append(directory) or real(directory))
    with caplog.at_level(logging.WARNING, "zpd.engine"):
        kernel = pd.PagedDecode(pd.load())
    assert "writable by others" in caplog.text
    assert not list(shared.iterdir())
    (temporary,) = built
    assert temporary != shared and not temporary.exists()        # removed once loaded
    q, k, v, rows, lens = _case(torch.float32, 2, 6, 2, 32, [10, 20])
    torch.testing.assert_close(kernel(q, k, v, rows, lens, 0.2).double(),
                               pd.reference(q, k, v, rows, lens, 0.2), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("why", ["no compiler", "switched off", "build fails"])
def test_without_a_kernel_decode_stays_on_torch_with_a_warning(fresh, caplog, why):
    if why == "no compiler":
        fresh.setenv("CXX", "no-such-compiler-zpd")
    elif why == "switched off":
        pd.configure(False)
    else:
        fresh.setattr(pd, "COMPILE_FLAGS", pd.COMPILE_FLAGS + ["-include", "no/such.h"])
    with caplog.at_level(logging.INFO, "zpd.engine"):
        engine = OfflineEngine(load_model("tiny", dtype="float32"))
    assert engine.compute.runner.kernel is None
    assert {"no compiler": "no C++ compiler", "switched off": "switched off",
            "build fails": "no/such.h"}[why] in caplog.text
    from engines.request import Request
    from engines.sampler import SamplingParams
    (out,) = engine.run([Request("r", [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=4,
                                                                ignore_eos=True))])
    assert len(out["output_ids"]) == 4


def test_a_kernel_that_disagrees_is_not_used(fresh, caplog):
    class Wrong:                            # a build whose arithmetic is off
        def __call__(self, q, *args):
            return torch.zeros_like(q)
    fresh.setattr(pd, "_kernel", Wrong)
    with caplog.at_level(logging.WARNING, "zpd.engine"):
        assert pd.kernel_for(torch.float32, "cpu") is None
    assert "disagrees" in caplog.text


def _has(flag: str) -> bool:
    try:
        return f" {flag}" in open("/proc/cpuinfo").read()
    except OSError:
        return False


# float32 sums: float32's rounding; bfloat16: then one rounding to bfloat16 (2^-8 relative)
@pytest.mark.parametrize("dtype,flag,tol", [(torch.float32, "avx512f", 1e-5), (torch.bfloat16, "avx512_bf16", 2 ** -8)])
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("n,k", [(40, 64), (13, 70), (1, 31), (576, 1536), (3072, 576)])
def test_small_products_equal_float64(dtype, flag, tol, rows, n, k):
    """1-8 rows; weight rows in and out of the kernel's blocks, lengths in and out of
    its vector steps."""
    kernel = pd.small_linear(dtype)
    if not _has(flag):
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
    if pd.small_linear(dtype) is None:
        assert not _has("avx512f" if dtype == torch.float32 else "avx512_bf16")
        return
    monkeypatch.setattr(pd, "packed_linear", lambda dtype: None)
    PACKED.configure(True)                                   # forget the AMX packing
    monkeypatch.setattr(PACKED, "_usable", {})
    calls = []
    real = pd.SmallLinear.__call__
    monkeypatch.setattr(pd.SmallLinear, "__call__", lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    model = load_model("tiny", dtype=str(dtype).removeprefix("torch."))
    from engines.request import Request
    from engines.sampler import SamplingParams
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 8], [1, 2, 3, 4]][:batch]
    with_kernel = OfflineEngine(model).run([Request(f"a{i}", p, params) for i, p in enumerate(prompts)])
    assert calls.count(batch) >= 7 * len(model.net.linears())    # 7 decode steps of `batch` rows
    monkeypatch.setattr(pd, "small_linear", lambda dtype: None)
    with_torch = OfflineEngine(model).run([Request(f"b{i}", p, params) for i, p in enumerate(prompts)])
    assert [o["output_ids"] for o in with_kernel] == [o["output_ids"] for o in with_torch]
    assert PACKED.usable(dtype) is not None              # more rows still packed


def _packed_kernel_expected(dtype) -> bool:
    if dtype == torch.bfloat16:
        return all(_has(f) for f in ("amx_bf16", "amx_tile", "avx512_bf16"))
    return _has("avx512f")


# panels sum each output in one float32 chain over K (1,536 terms here): 1e-4
PACKED_KINDS = [(torch.bfloat16, pd.AmxLinear, 2 ** -8, 1e-3), (torch.float32, pd.PanelLinear, 1e-4, 1e-4)]


@pytest.mark.parametrize("dtype,kind,rtol,atol", PACKED_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 8, 15, 16, 17, 31, 32, 33, 64, 100, 256])
@pytest.mark.parametrize("n,k", [(40, 64), (13, 96), (1, 32), (576, 1536), (960, 576)])
def test_packed_products_equal_float64(dtype, kind, rtol, atol, rows, n, k):
    """Rows within, at and across the kernels' blocks of 16 and 32; outputs short of,
    at and past their blocks; with and without a bias."""
    kernel = pd.packed_linear(dtype)
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
    element [p, k, n] is w[16 p + n, k]; the rows that pad N are zero."""
    w = torch.arange(40 * 64, dtype=torch.float32).view(40, 64)
    packed = pd.AmxLinear.layout(w.to(torch.bfloat16))
    assert packed.shape == (2, 2, 2, 16, 16, 2)
    for b, s, h, r, n, j in [(0, 0, 0, 0, 0, 0), (0, 1, 1, 3, 5, 1), (1, 0, 0, 15, 7, 0), (0, 1, 1, 15, 15, 1)]:
        assert packed[b, s, h, r, n, j] == w.to(torch.bfloat16)[32 * b + 16 * h + n, 32 * s + 2 * r + j]
    assert not packed[1, :, :, :, 8:].any() and not packed[1, :, 1].any()
    panels = pd.PanelLinear.layout(w)
    assert panels.shape == (3, 64, 16)
    for p, k, n in [(0, 0, 0), (1, 5, 9), (2, 63, 7)]:
        assert panels[p, k, n] == w[16 * p + n, k]
    assert not panels[2, :, 8:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(1, 32), (13, 96), (40, 64), (960, 576), (576, 1536)])
def test_the_librarys_packing_is_the_layout(dtype, n, k):
    """`pack` (C++, threads) writes exactly `layout` (torch), padding rows included,
    from row-major and column-major weights."""
    kernel = pd.packed_linear(dtype)
    if kernel is None:
        assert not _packed_kernel_expected(dtype)
        return
    w = torch.randn(n, k).to(dtype)
    assert torch.equal(kernel.pack(w), kernel.layout(w).view(-1))
    assert torch.equal(kernel.pack(w.t().contiguous().t()), kernel.layout(w).view(-1))


def test_packed_kernels_refuse_bad_shapes():
    for dtype in (torch.bfloat16, torch.float32):
        kernel = pd.packed_linear(dtype)
        if kernel is None:
            assert not _packed_kernel_expected(dtype)
            continue
        w = torch.randn(8, 64).to(dtype)
        with pytest.raises(AssertionError):                      # a packing of another size
            kernel(torch.randn(2, 64).to(dtype), kernel.pack(w)[:1], 40)
        with pytest.raises(AssertionError):                      # another dtype
            kernel(torch.randn(2, 64).double(), kernel.pack(w), 8)
    if pd.packed_linear(torch.bfloat16) is not None:             # AMX: K a multiple of 32
        with pytest.raises(AssertionError):
            pd.packed_linear(torch.bfloat16)(torch.randn(2, 48).to(torch.bfloat16),
                                             torch.zeros(32 * 48, dtype=torch.bfloat16), 8)
    w = torch.randn(8, 64)
    assert not pd.AmxLinear.fits(torch.randn(8, 48).to(torch.bfloat16)) and not pd.AmxLinear.fits(w)
    assert pd.AmxLinear.fits(w.to(torch.bfloat16)) and pd.PanelLinear.fits(torch.randn(8, 48))


@pytest.mark.parametrize("dtype,kind", [(torch.bfloat16, pd.AmxLinear), (torch.float32, pd.PanelLinear)])
def test_a_wrong_packed_kernel_is_not_used(monkeypatch, caplog, dtype, kind):
    """A packing in the wrong layout (here: its last two dimensions swapped) is caught
    by the first-use check against float64."""
    if pd.packed_linear(dtype) is None:
        assert not _packed_kernel_expected(dtype)
        return
    right = kind.layout
    wrong = staticmethod(lambda w: right(w).transpose(-1, -2).contiguous())
    monkeypatch.setattr(kind, "layout", wrong)
    monkeypatch.setattr(kind, "pack", lambda self, w: wrong(w).view(-1))
    pd.packed_linear.cache_clear()
    try:
        assert pd.packed_linear(dtype) is None
        assert f"{kind.__name__} product kernel disagrees" in caplog.text
    finally:
        monkeypatch.undo()
        pd.packed_linear.cache_clear()
    assert pd.packed_linear(dtype) is not None


@pytest.mark.parametrize("dtype,batch", [(torch.bfloat16, 1), (torch.bfloat16, 3), (torch.bfloat16, 10),
                                         (torch.float32, 10)])
def test_model_products_go_to_the_packed_kernels(monkeypatch, dtype, batch):
    """The model's decode products go to the packed-weight kernel: in bfloat16 (AMX)
    at every batch, none to the dot-product kernel or oneDNN; in float32 (panels) past
    8 rows; and they give the tokens torch's products give."""
    from engines.linear import PACKED
    kernel = pd.packed_linear(dtype)
    if kernel is None:
        assert not _packed_kernel_expected(dtype)
        return
    calls, small = [], []
    real = type(kernel).__call__
    monkeypatch.setattr(type(kernel), "__call__", lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    monkeypatch.setattr(pd.SmallLinear, "__call__", lambda self, x, *a: small.append(x))
    PACKED.configure(True)
    model = load_model("tiny", dtype=str(dtype).removeprefix("torch."))
    from engines.request import Request
    from engines.sampler import SamplingParams
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    prompts = [[5 + i, 6, 7 + i % 3] for i in range(batch)]
    with_kernel = OfflineEngine(model).run([Request(f"a{i}", p, params) for i, p in enumerate(prompts)])
    assert calls.count(batch) >= 7 * len(model.net.linears()) and not small
    assert PACKED.usable(dtype).name == type(kernel).__name__
    monkeypatch.setattr(PACKED, "enabled", False)
    monkeypatch.setattr(PACKED, "_usable", {})
    monkeypatch.setattr(pd, "small_linear", lambda dtype: None)
    with_torch = OfflineEngine(model).run([Request(f"b{i}", p, params) for i, p in enumerate(prompts)])
    assert [o["output_ids"] for o in with_kernel] == [o["output_ids"] for o in with_torch]
    PACKED.configure(True)


def _ops(dtype) -> pd.LayerOps:
    ops = pd.layer_ops(dtype, "cpu")
    assert ops is not None, "the layer kernels did not build or load"
    return ops


# bfloat16: torch's roundings are kept, so results differ by at most one rounding of
# a float32 sum computed in another order (one bfloat16 step, 2^-8 relative)
_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 64), (40, 100), (300, 17)])
def test_norms_and_silu_equal_torchs(dtype, rows, dim):
    """One row, a few (one thread) and many (shared among threads); widths in and out
    of vector steps."""
    ops, (norm, _) = _ops(dtype), pd._torch_ops(dtype)
    g = torch.Generator().manual_seed(rows * dim)
    x, res = (torch.randn(rows, dim, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), norm(x, w, 1e-6), **_TOL[dtype])
    out, total = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, x + res)                        # one rounding, as torch's add
    torch.testing.assert_close(out, norm(x + res, w, 1e-6), **_TOL[dtype])
    gate_up = torch.randn(rows, 2 * dim, generator=g).to(dtype)
    gate, up = gate_up.split(dim, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, **_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hq,hkv,d", [(1, 9, 3, 64), (3, 4, 4, 16), (64, 8, 2, 128)])
def test_rope_write_equals_torchs_rotary_and_write(dtype, rows, hq, hkv, d):
    """Queries rotated as engines/rope.py rotates them; keys rotated and values copied
    into their pool rows, and no other row touched."""
    from engines.rope import RotaryEmbedding, apply_rotary
    ops = _ops(dtype)
    g = torch.Generator().manual_seed(rows + d)
    rope = RotaryEmbedding(d, 4096, 10000.0, None, dtype, torch.device("cpu"))
    cos, sin = rope.tables(torch.randint(0, 4096, (rows,), generator=g))
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to(dtype)
    k_rows, v_rows = torch.randn(2, rows * 3, hkv, d, generator=g).to(dtype)
    k_before, v_before = k_rows.clone(), v_rows.clone()
    where = torch.randperm(rows * 3, generator=g)[:rows]
    q = ops.rope_write(qkv, cos, sin, where, k_rows, v_rows, hq)
    qk = apply_rotary(qkv[:, :(hq + hkv) * d].view(rows, hq + hkv, d), cos, sin)
    torch.testing.assert_close(q, qk[:, :hq], **_TOL[dtype])
    q2, k = ops.rope_write(qkv, cos, sin, where, k_rows, v_rows, hq, keys=True)   # a prefill's
    assert torch.equal(q2, q) and torch.equal(k, k_rows[where])
    torch.testing.assert_close(k_rows[where], qk[:, hq:], **_TOL[dtype])
    assert torch.equal(v_rows[where], qkv[:, (hq + hkv) * d:].view(rows, hkv, d))
    others = torch.ones(rows * 3, dtype=torch.bool)
    others[where] = False
    assert torch.equal(k_rows[others], k_before[others]) and torch.equal(v_rows[others], v_before[others])


def test_rope_write_refuses_rows_outside_the_pool():
    """A write row past the pool (or negative) is refused before anything is written."""
    ops = _ops(torch.float32)
    qkv, cos, sin = torch.randn(2, 3 * 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    k_rows, v_rows = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    for bad in ([0, 4], [-1, 0]):
        with pytest.raises(RuntimeError, match="out of range"):
            ops.rope_write(qkv, cos, sin, torch.tensor(bad), k_rows, v_rows, 1)
        assert not k_rows.any() and not v_rows.any()


def test_layer_ops_only_for_their_dtypes_and_cpu(fresh):
    assert pd.layer_ops(torch.float64, "cpu") is None and pd.layer_ops(torch.float32, "cuda") is None
    pd.configure(False)
    assert pd.layer_ops(torch.float32, "cpu") is None


def test_layer_ops_that_disagree_are_not_used(fresh, caplog):
    """A library whose steps disagree with torch's is found out by the first-use check."""
    fresh.setattr(pd.LayerOps, "silu_mul", lambda self, gate_up: torch.zeros(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype))
    assert pd.layer_ops(torch.float32, "cpu") is None
    assert "layer kernels disagree" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 1), (1, 49152), (16, 1000), (5, 63), (3, 65)])
def test_argmax_is_torchs(dtype, rows, n):
    """The first maximum of each row, as torch.argmax: ties, infinities, NaN (which
    torch takes as the maximum), rows of one element, lengths in and out of blocks."""
    ops = _ops(dtype)
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g).to(dtype)
    assert torch.equal(ops.argmax(x), x.argmax(-1))
    if n > 10:
        x[0, n - 1] = x[0, 3] = 50.0                          # a tie: the first
        if rows > 1:
            x[1] = float("-inf")                              # all -inf: index 0
        if rows > 2:
            x[2, 5], x[2, n - 2] = float("inf"), float("nan")  # NaN beats +inf
        assert torch.equal(ops.argmax(x), x.argmax(-1))


def test_sampler_greedy_takes_the_kernels_argmax(monkeypatch):
    """Greedy rows are picked by the kernel from the model's dtype (no float32 copy),
    with torch's answer."""
    from engines import sampler as sm
    calls = []
    real = pd.LayerOps.argmax
    monkeypatch.setattr(pd.LayerOps, "argmax", lambda self, x: calls.append(x.dtype) or real(self, x))
    logits = torch.randn(4, 300).to(torch.bfloat16)
    params = [sm.SamplingParams(temperature=0)] * 4
    got = sm.Sampler()(logits, params, [0] * 4, [0] * 4, [[1]] * 4, [[]] * 4)
    assert got == logits.argmax(-1).tolist() and calls == [torch.bfloat16]


def test_a_packing_that_is_not_its_layout_is_not_used(monkeypatch, caplog):
    for dtype, kind in ((torch.bfloat16, pd.AmxLinear), (torch.float32, pd.PanelLinear)):
        if pd.packed_linear(dtype) is None:
            assert not _packed_kernel_expected(dtype)
            continue
        monkeypatch.setattr(kind, "pack", lambda self, w: torch.zeros_like(kind.layout(w).view(-1)))
        pd.packed_linear.cache_clear()
        try:
            assert pd.packed_linear(dtype) is None
            assert f"{kind.__name__} packing is not its layout" in caplog.text
        finally:
            monkeypatch.undo()
            pd.packed_linear.cache_clear()


def _causal_reference(q, k, v, scale):
    return torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None].double() for t in (q, k, v)), is_causal=True, scale=scale,
        enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 200])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 64), (8, 2, 128)])
def test_causal_attention_equals_float64(n, hq, hkv, d):
    """Prompts shorter than, at and past the kernel's blocks of 64 positions; grouped
    and plain heads; heads of 64 and 128; values read through a strided view (as the
    engine hands them: a slice of the fused projection)."""
    ops = _ops(torch.float32)
    g = torch.Generator().manual_seed(n * hq + d)
    q, k = torch.randn(n, hq, d, generator=g), torch.randn(n, hkv, d, generator=g)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)                    # strided, as in a prefill
    got = ops.causal_attention(q, k, v, d ** -0.5)
    assert got is not None and got.shape == q.shape
    torch.testing.assert_close(got.double(), _causal_reference(q, k, v, d ** -0.5), rtol=1e-4, atol=1e-5)


def test_causal_attention_leaves_what_it_does_not_take_to_torch():
    """bfloat16 (torch's flash attention multiplies in bfloat16, faster) and heads
    other than 64 and 128 get None: the caller uses torch's attention."""
    q = torch.randn(10, 4, 64)
    assert _ops(torch.bfloat16).causal_attention(q.bfloat16(), q[:, :2].bfloat16(), q[:, 2:].bfloat16(), 0.1) is None
    q = torch.randn(10, 4, 32)
    assert _ops(torch.float32).causal_attention(q, q[:, :2], q[:, 2:], 0.1) is None


def test_prefill_attention_by_the_kernel_equals_torchs():
    """SmolLM2's shapes (9 heads of 64 over 3), three packed prompts: prefill attention
    with the kernel equals torch's to float32 rounding."""
    from engines.attention import PrefillMeta, prefill_attention
    ops = _ops(torch.float32)
    g = torch.Generator().manual_seed(0)
    lens = [70, 1, 130]
    q, k = torch.randn(sum(lens), 9, 64, generator=g), torch.randn(sum(lens), 3, 64, generator=g)
    v = torch.randn(sum(lens), 3, 64, generator=g)
    meta = PrefillMeta(lens, torch.zeros(sum(lens), dtype=torch.long))
    got = prefill_attention(q, k, v, meta, 0.125, ops=ops)
    want = prefill_attention(q, k, v, meta, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
