"""A mixture's routed experts in one call of the CPU library per layer
(engines/cpu/experts.cpp): the (token, expert) pairs sorted by expert, each chosen
expert's MLP on its tokens by the small-batch products' blocks, 8 rows at a time,
straight from the stacked row-major weights (no packed copy), and the weighted sum.
Only the chosen experts' weights are read, and no Python runs per expert: torch's
grouped loop (engines/torch_backend.py) costs a few torch calls per chosen expert, up
to B * k of them per layer in a decode step. Checked once per process and dtype
against float64 (`grouped_experts`)."""
from __future__ import annotations

import ctypes
import logging

import torch

from engines.cpu.kernels import C_INT64, DTYPES, describe, library, once

log = logging.getLogger("zpd.engine")


class GroupedExperts:
    """out[t] = sum_j weights[t, j] * MLP_{ids[t, j]}(x[t]) for one dtype (float32 on
    AVX-512, bfloat16 on AVX512-BF16), summed in float32."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.fn = getattr(lib, f"zpd_experts_{str(dtype).removeprefix('torch.')}")
        p = ctypes.c_void_p
        self.fn.argtypes = [p, p, p, p, p, p, C_INT64, C_INT64, C_INT64, C_INT64, C_INT64, ctypes.c_int]
        self.fn.restype = ctypes.c_int

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """x [T, H]; ids [T, k] (any integer dtype); weights [T, k]; gate_up [E, 2I, H]
        (each expert's gate rows, then its up rows); down [E, H, I] -> [T, H]."""
        e, two_i, h = gate_up.shape
        assert x.dtype == gate_up.dtype == down.dtype == self.dtype and x.dim() == 2 and x.shape[1] == h
        assert down.shape == (e, h, two_i // 2) and ids.shape == weights.shape and ids.shape[0] == x.shape[0]
        assert gate_up.is_contiguous() and down.is_contiguous()
        x = x.contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        status = self.fn(x.data_ptr(), ids.data_ptr(), weights.data_ptr(), gate_up.data_ptr(),
                         down.data_ptr(), out.data_ptr(), x.shape[0], ids.shape[1], e, h, two_i // 2,
                         torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{self.dtype} experts kernel: {describe(status)}")
        return out


def reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """The same in float64, every (token, expert) pair by its expert's gathered weights
    (for checks and tests)."""
    inter, flat = down.shape[2], ids.reshape(-1).long()
    xs = x.double().repeat_interleave(ids.shape[1], dim=0)                     # [P, H]
    gu = torch.einsum("ph,pih->pi", xs, gate_up.double()[flat])
    h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    ys = torch.einsum("pi,phi->ph", h, down.double()[flat]) * weights.reshape(-1, 1).double()
    return ys.view(*ids.shape, -1).sum(1)


def _agrees(kernel: GroupedExperts) -> bool:
    """Whether the kernel gives float64's mixture (to its dtype's rounding) for tokens
    of 1 to 19 rows, an expert chosen by more than one chunk of rows, experts nobody
    chose, and lengths in and out of its vector steps (False, with a warning, where not
    or where this CPU lacks the instructions)."""
    g, dt = torch.Generator().manual_seed(0), kernel.dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dt == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    try:
        for experts, hidden, inter, k, tokens in ((4, 64, 32, 2, 1), (6, 40, 24, 3, 19), (3, 32, 70, 1, 5)):
            gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dt)
            down = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dt)
            x = torch.randn(tokens, hidden, generator=g).to(dt)
            ids = torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(tokens)])
            weights = torch.rand(tokens, k, generator=g)
            want = reference(x, ids, weights, gate_up, down)
            if not torch.allclose(kernel(x, ids, weights, gate_up, down).double(), want, **tol):
                log.warning("the %s experts kernel disagrees with float64; using torch's grouped experts", dt)
                return False
    except RuntimeError as e:
        log.info("%s experts kernel not used (%s)", dt, e)
        return False
    return True


@once
def grouped_experts(dtype: torch.dtype) -> GroupedExperts | None:
    """The experts kernel for `dtype` (float32, bfloat16), checked once; None: torch's
    grouped loop."""
    lib = library() if dtype in DTYPES else None
    try:
        kernel = None if lib is None else GroupedExperts(lib, dtype)
    except AttributeError as e:
        log.warning("%s experts kernel unavailable (%s); using torch's grouped experts", dtype, e)
        return None
    return kernel if kernel is not None and _agrees(kernel) else None
