"""The CPU library's layer steps (engines/cpu/layer_ops.py): norms, SiLU * up, the
rotary write into the pool, argmax and causal attention against torch's ops and
float64, and their first-use checks."""
from __future__ import annotations

import pytest
import torch

import engines.cpu.layer_ops as co
from engines.cpu.kernels import configure
from tests.unit.cpu_support import cpu_has, require_compiler

require_compiler()


def _ops(dtype) -> co.LayerOps:
    ops = co.layer_ops(dtype, "cpu")
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
    ops, (norm, _) = _ops(dtype), co._torch_ops(dtype)
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
    """Queries rotated as engines/models/rope.py rotates them; keys rotated and values copied
    into their pool rows, and no other row touched."""
    from engines.models.rope import RotaryEmbedding, apply_rotary
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
    assert co.layer_ops(torch.float64, "cpu") is None and co.layer_ops(torch.float32, "cuda") is None
    configure(False)
    assert co.layer_ops(torch.float32, "cpu") is None


def test_layer_ops_that_disagree_are_not_used(fresh, caplog):
    """A library whose steps disagree with torch's is found out by the first-use check."""
    fresh.setattr(co.LayerOps, "silu_mul", lambda self, gate_up: torch.zeros(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype))
    assert co.layer_ops(torch.float32, "cpu") is None
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
    from engines.cpu.backend import CpuBackend
    calls = []
    real = co.LayerOps.argmax
    monkeypatch.setattr(co.LayerOps, "argmax", lambda self, x: calls.append(x.dtype) or real(self, x))
    logits = torch.randn(4, 300).to(torch.bfloat16)
    params = [sm.SamplingParams(temperature=0)] * 4
    sampler = sm.Sampler(argmax=CpuBackend(torch.bfloat16).argmax)
    got = sampler(logits, params, [0] * 4, [0] * 4, [[1]] * 4, [[]] * 4)
    assert got == logits.argmax(-1).tolist() and calls == [torch.bfloat16]


def _causal_reference(q, k, v, scale):
    return torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None].double() for t in (q, k, v)), is_causal=True, scale=scale,
        enable_gqa=True)[0].transpose(0, 1)


def _causal_inputs(n, hq, hkv, d, dtype):
    g = torch.Generator().manual_seed(n * hq + d)
    q, k = torch.randn(n, hq, d, generator=g).to(dtype), torch.randn(n, hkv, d, generator=g).to(dtype)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype)
    return q, k, qkv[:, (hq + hkv) * d:].view(n, hkv, d)           # v strided, as in a prefill


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 200])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 64), (8, 2, 128)])
def test_causal_attention_equals_float64(n, hq, hkv, d):
    """Prompts shorter than, at and past the kernel's blocks of 64 positions; grouped
    and plain heads; heads of 64 and 128; values read through a strided view (as the
    engine hands them: a slice of the fused projection)."""
    q, k, v = _causal_inputs(n, hq, hkv, d, torch.float32)
    got = _ops(torch.float32).causal_attention(q, k, v, d ** -0.5)
    assert got is not None and got.shape == q.shape
    torch.testing.assert_close(got.double(), _causal_reference(q, k, v, d ** -0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 200])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 64), (8, 2, 128)])
def test_bfloat16_causal_attention_is_as_close_as_torchs(n, hq, hkv, d):
    """The AMX kernel (blocks of 16 queries by 64 keys, packed in 32s): prompts within,
    at and past each block size. Its error against float64 is within 5% of torch's own
    bfloat16 flash attention's (both multiply in bfloat16 and round the weights to it);
    without AMX the same blocks by AVX512-BF16 dot products, or the float32 kernel on
    copies; without AVX-512 it declines and the caller uses torch's."""
    q, k, v = _causal_inputs(n, hq, hkv, d, torch.bfloat16)
    got = _ops(torch.bfloat16).causal_attention(q, k, v, d ** -0.5)
    if not cpu_has("avx512f"):
        assert got is None
        return
    want = _causal_reference(q, k, v, d ** -0.5)
    torchs = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=d ** -0.5,
        enable_gqa=True)[0].transpose(0, 1)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    ours_err, torchs_err = ((t.double() - want).abs() for t in (got, torchs))
    assert ours_err.max() <= 1.05 * torchs_err.max() + 1e-3
    assert ours_err.mean() <= 1.05 * torchs_err.mean() + 1e-4


def test_bfloat16_causal_attention_without_its_kernels_runs_on_float32_copies(monkeypatch):
    """Where the bfloat16 kernel declines (no AMX, no AVX512-BF16), a bfloat16 prompt
    takes the float32 kernel on float32 copies: exactly its output, rounded."""
    import engines.cpu.layer_ops as lo
    ops, q, k, v = _ops(torch.bfloat16), *_causal_inputs(100, 9, 3, 64, torch.bfloat16)
    if ops.causal_attention(q, k, v, 0.125) is None:
        assert not cpu_has("avx512f")
        return
    monkeypatch.setattr(ops, "_causal", lambda *a: lo.UNSUPPORTED)
    got = ops.causal_attention(q, k, v, 0.125)
    want = _ops(torch.float32).causal_attention(q.float(), k.float(), v.float(), 0.125)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


def test_causal_attention_leaves_what_it_does_not_take_to_torch():
    """Heads other than 64 and 128 get None: the caller uses torch's attention."""
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(10, 4, 32).to(dtype)
        assert _ops(dtype).causal_attention(q, q[:, :2], q[:, 2:], 0.1) is None


def test_prefill_attention_by_the_kernel_equals_torchs():
    """SmolLM2's shapes (9 heads of 64 over 3), three packed prompts: prefill attention
    with the kernel equals torch's to float32 rounding."""
    from engines.kv.meta import PrefillMeta
    from engines.torch_backend import prefill_attention
    ops = _ops(torch.float32)
    g = torch.Generator().manual_seed(0)
    lens = [70, 1, 130]
    q, k = torch.randn(sum(lens), 9, 64, generator=g), torch.randn(sum(lens), 3, 64, generator=g)
    v = torch.randn(sum(lens), 3, 64, generator=g)
    meta = PrefillMeta(lens, torch.zeros(sum(lens), dtype=torch.long))
    got = prefill_attention(q, k, v, meta, 0.125, causal=ops.causal_attention)
    want = prefill_attention(q, k, v, meta, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
