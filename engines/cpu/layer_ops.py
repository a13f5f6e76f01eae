"""A layer's element-wise steps, greedy argmax (engines/cpu/layer_ops.cpp) and a
prompt's causal attention (engines/cpu/prefill_attention.cpp) in the CPU library, each
one call instead of several torch ops; checked against torch's ops once per process
(`layer_ops`).
"""
from __future__ import annotations

import ctypes
import logging

import torch

from engines.cpu.kernels import C_INT64, DTYPES, UNSUPPORTED, describe, library, once

log = logging.getLogger("zpd.engine")



class LayerOps:
    """A layer's element-wise steps for one dtype, each one call and one pass instead
    of 4-9 torch ops (at decode, torch's per-op cost is most of their time): RMSNorm,
    with the residual addition before it; SiLU(gate) * up; rotary embedding of queries
    and keys with the write of keys and values into the pool. Each rounds to the
    dtype where torch's ops do, so it gives torch's results to within float32
    reordering."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        name, p, i64 = str(dtype).removeprefix("torch."), ctypes.c_void_p, C_INT64
        self.dtype = dtype
        self._norm = getattr(lib, f"zpd_rms_norm_{name}")
        self._norm.argtypes = [p, p, p, ctypes.c_float, p, p, i64, i64, ctypes.c_int]
        self._norm.restype = None
        self._silu = getattr(lib, f"zpd_silu_mul_{name}")
        self._silu.argtypes = [p, p, i64, i64, ctypes.c_int]
        self._silu.restype = None
        self._argmax = getattr(lib, f"zpd_argmax_{name}")
        self._argmax.argtypes = [p, i64, i64, p, ctypes.c_int]
        self._argmax.restype = None
        self._causal, self._causal_float32 = (
            getattr(lib, f"zpd_causal_attention_{kind}") for kind in (name, "float32"))  # bfloat16: on AMX
        for f in (self._causal, self._causal_float32):
            f.argtypes = [p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, ctypes.c_int]
            f.restype = ctypes.c_int
        self._rope = getattr(lib, f"zpd_rope_write_{name}")
        self._rope.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, p, p, p, p, ctypes.c_int]
        self._rope.restype = ctypes.c_int

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, dim] -> weight * norm(x)."""
        assert x.dtype == weight.dtype == self.dtype and x.is_contiguous() and x.shape[-1] == weight.numel()
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), None, weight.data_ptr(), eps, out.data_ptr(), None, x.shape[0],
                   x.shape[1], torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weight * norm(x + residual), x + residual)."""
        assert x.dtype == residual.dtype == weight.dtype == self.dtype and x.shape == residual.shape
        assert x.is_contiguous() and residual.is_contiguous() and x.shape[-1] == weight.numel()
        out, total = torch.empty_like(x), torch.empty_like(x)
        self._norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
                   total.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
        return out, total

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 I] (gate, then up) -> silu(gate) * up, [T, I]."""
        assert gate_up.dtype == self.dtype and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._silu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], out.shape[1],
                   torch.get_num_threads())
        return out

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor | None:
        """One prompt's causal attention to itself: q [n, Hq, D]; k, v [n, Hkv, D]
        (each position's heads contiguous) -> [n, Hq, D]; None where the kernel does not
        take it (head sizes other than 64 and 128; a CPU without AVX-512).

        bfloat16 runs on AMX where the CPU has it, else by AVX512-BF16 dot products,
        else in float32 arithmetic on float32 copies (all faster than torch's bfloat16
        flash attention without AMX: on an AMD EPYC with AVX512-BF16, SmolLM2's shapes
        at 1,024 positions, 12.4 ms a layer against 4.75 by dot products and 7.5 on
        copies, alternating; the dot products' error against float64 is torch's)."""
        if q.shape[-1] not in (64, 128):
            return None
        n, hq, d = q.shape
        assert q.dtype == k.dtype == v.dtype == self.dtype and q.is_contiguous()
        assert k.shape == v.shape and k.shape[0] == n and k.shape[2] == d and hq % k.shape[1] == 0
        assert k.stride()[1:] == (d, 1) and v.stride()[1:] == (d, 1)
        out = self._run_causal(self._causal, q, k, v, scale)
        if out is None and self.dtype == torch.bfloat16:
            out = self._run_causal(self._causal_float32, q.float(), k.float(), v.float(), scale)
            return None if out is None else out.to(torch.bfloat16)
        return out

    @staticmethod
    def _run_causal(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor | None:
        (n, hq, d), out = q.shape, torch.empty_like(q)
        status = kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), n, hq,
                        k.shape[1], d, scale, out.data_ptr(), torch.get_num_threads())
        if status == UNSUPPORTED:
            return None
        if status != 0:
            raise RuntimeError(f"causal attention kernel: {describe(status)}")
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[B, V] -> [B] int64: torch.argmax(x, -1), a NaN counting as the maximum.
        torch's CPU argmax is a scalar loop: 0.84 ms for 16 x 49,152 float32 logits
        (2.3 ms in bfloat16), where this takes tens of microseconds."""
        assert x.dtype == self.dtype and x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
        return out

    def rope_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   write_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                   q_heads: int, keys: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """qkv: [T, (Hq + 2 Hkv) D]; cos, sin: [T, 1, D]; write_rows: [T] rows of k_rows
        and v_rows ([R, Hkv, D], contiguous from their first row). Writes the rotated
        keys and the values there; -> rotated queries [T, Hq, D] (with `keys`, and the
        rotated keys [T, Hkv, D], for a prefill to attend to)."""
        t, (_, hkv, d) = qkv.shape[0], k_rows.shape
        assert qkv.dtype == cos.dtype == sin.dtype == k_rows.dtype == v_rows.dtype == self.dtype
        assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
        assert qkv.shape[1] == (q_heads + 2 * hkv) * d and cos.shape == sin.shape == (t, 1, d)
        assert write_rows.dtype == torch.int64 and write_rows.is_contiguous() and write_rows.numel() == t
        q = qkv.new_empty(t, q_heads, d)
        k = qkv.new_empty(t, hkv, d) if keys else None
        status = self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), write_rows.data_ptr(),
                            min(len(k_rows), len(v_rows)), t, q_heads, hkv, d, q.data_ptr(),
                            k_rows.data_ptr(), v_rows.data_ptr(), None if k is None else k.data_ptr(),
                            torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"rotary kernel: {describe(status)}")
        return (q, k) if keys else q


def _torch_ops(dtype: torch.dtype):
    """torch's versions of LayerOps' steps (as engines/models/llama.py computes them)."""
    def norm(x, weight, eps):
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    def rope(x, cos, sin):
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
    return norm, rope


def _layer_ops_agree(ops: LayerOps) -> bool:
    """Whether each step gives torch's result (to float32 reordering, then the dtype's
    rounding) on random inputs, rows on one thread and on several; False, with a
    warning, where not."""
    g, dt = torch.Generator().manual_seed(0), ops.dtype
    norm, rope = _torch_ops(dt)
    tol = dict(rtol=1e-5, atol=1e-5) if dt == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    ok = True
    for rows in (3, 40):
        x, res = (torch.randn(rows, 72, generator=g).to(dt) for _ in range(2))
        w = torch.rand(72, generator=g).to(dt) + 0.5
        out, total = ops.add_rms_norm(x, res, w, 1e-5)
        ok &= torch.equal(total, x + res) and torch.allclose(out.float(), norm(x + res, w, 1e-5).float(), **tol)
        ok &= torch.allclose(ops.rms_norm(x, w, 1e-5).float(), norm(x, w, 1e-5).float(), **tol)
        gu = torch.randn(rows, 2 * 40, generator=g).to(dt)
        gate, up = gu.split(40, dim=-1)
        ok &= torch.allclose(ops.silu_mul(gu).float(), (torch.nn.functional.silu(gate) * up).float(), **tol)
        qkv = torch.randn(rows, (3 + 2 * 1) * 8, generator=g).to(dt)
        cos, sin = (torch.randn(rows, 1, 8, generator=g).to(dt) for _ in range(2))
        k_rows, v_rows = torch.zeros(rows + 5, 1, 8, dtype=dt), torch.zeros(rows + 5, 1, 8, dtype=dt)
        where = torch.randperm(rows + 5, generator=g)[:rows]
        q, k = ops.rope_write(qkv, cos, sin, where, k_rows, v_rows, 3, keys=True)
        qk = rope(qkv[:, :32].view(rows, 4, 8), cos, sin)
        ok &= torch.allclose(q.float(), qk[:, :3].float(), **tol) and torch.equal(k, k_rows[where])
        ok &= torch.allclose(k_rows[where].float(), qk[:, 3:].float(), **tol)
        ok &= torch.equal(v_rows[where], qkv[:, 32:].view(rows, 1, 8))
    # bfloat16: products of bfloat16 inputs, weights rounded to bfloat16 (as torch's)
    causal_tol = dict(rtol=1e-4, atol=1e-5) if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for n, hq, hkv, d in ((70, 4, 2, 64), (130, 2, 1, 128)):
        q, k, v = (torch.randn(n, h, d, generator=g).to(dt) for h in (hq, hkv, hkv))
        got = ops.causal_attention(q, k, v, d ** -0.5)
        if got is not None:
            want = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(0, 1)[None].double() for t in (q, k, v)), is_causal=True,
                scale=d ** -0.5, enable_gqa=True)[0].transpose(0, 1)
            ok &= torch.allclose(got.double(), want, **causal_tol)
    x = torch.randn(5, 1000, generator=g).to(dt)
    x[1, 7] = x[1, 900] = 10.0                     # ties: the first one
    x[2, 500] = float("nan")                       # a NaN is the maximum, as for torch
    x[3, 3] = x[3, 999] = float("nan")
    ok &= torch.equal(ops.argmax(x), x.argmax(-1)) and torch.equal(ops.argmax(x[:1]), x[:1].argmax(-1))
    if not ok:
        log.warning("the %s layer kernels disagree with torch's ops; using torch's", dt)
    return bool(ok)


@once
def layer_ops(dtype: torch.dtype, device_type: str) -> LayerOps | None:
    """The element-wise layer kernels for `dtype` on `device_type`, checked once; None:
    torch's ops (other dtypes and devices, or no working library)."""
    lib = library() if device_type == "cpu" and dtype in DTYPES else None
    try:
        ops = None if lib is None else LayerOps(lib, dtype)
    except AttributeError as e:
        log.warning("layer kernels unavailable (%s); using torch's ops", e)
        return None
    return ops if ops is not None and _layer_ops_agree(ops) else None
