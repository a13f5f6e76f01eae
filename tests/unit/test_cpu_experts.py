"""The CPU backend's routed experts (engines/cpu/backend.py `experts`: the library's
kernel, engines/cpu/experts.py, for decode steps and short prompts, torch's grouped
loop by packed copies for long ones) against torch's grouped reference and float64:
decode batches of 1 and 16, a prompt of ~100 rows on both paths, experts nobody chose,
and weight updates, in place and by a swapped storage, which the packed copies follow."""
from __future__ import annotations

import pytest
import torch

from engines.cpu import backend as cpu_backend
from engines.cpu.backend import CpuBackend
from engines.cpu.experts import grouped_experts, reference
from engines.models.moe import Experts
from engines.torch_backend import TorchBackend
from tests.unit.cpu_support import cpu_has, require_compiler

require_compiler()

HIDDEN, INTER = 64, 48
# the reference rounds each product and sum to the dtype, the kernel sums in float32
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float64: 1e-12}
FLAGS = {torch.float32: "avx512f", torch.bfloat16: "avx512_bf16"}


def _experts(num: int, dtype: torch.dtype, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    ex = Experts(num, HIDDEN, INTER)
    with torch.no_grad():
        ex.gate_up_proj.data = (torch.randn(num * 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dtype)
        ex.down_proj.data = (torch.randn(num * HIDDEN, INTER, generator=g) / INTER ** 0.5).to(dtype)
    return ex


def _routing(tokens: int, num: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, ids, weights; the last two experts are never chosen."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    weights, ids = torch.softmax(torch.randn(tokens, num - 2, generator=g), -1).topk(k)
    return x, ids, weights


def _check(backend: CpuBackend, ex: Experts, x, ids, weights, dtype) -> torch.Tensor:
    got = backend.experts(x.to(dtype), ids, weights, ex)
    want = TorchBackend().experts(x.to(dtype), ids, weights, ex)
    exact = reference(x.to(dtype), ids, weights, *ex.stacked())
    tol = TOLERANCE[dtype]
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    assert torch.allclose(got.double(), exact, rtol=tol, atol=tol)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("tokens", [1, 16, 100])
def test_cpu_experts_equal_the_grouped_reference(dtype, tokens):
    """16 experts, top-2: every size by the kernel (100 rows: ~12 per expert) where
    the CPU has it; float64 by torch's loop."""
    ex = _experts(16, dtype)
    x, ids, weights = _routing(tokens, 16, 2, seed=tokens)
    _check(CpuBackend(dtype), ex, x, ids, weights, dtype)
    kernel = grouped_experts(dtype)
    if dtype in FLAGS:
        assert (kernel is not None) == cpu_has(FLAGS[dtype])
    else:
        assert kernel is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prompt_runs_the_loop_by_packed_copies_that_follow_weight_updates(dtype):
    """4 experts, top-2, 100 rows: 50 per expert, past GROUPED_MAX_ROWS_PER_EXPERT, so
    torch's loop multiplies by packed copies held on the experts' views; an in-place
    update of the stacked weights and a swapped storage each give the new products."""
    assert 100 * 2 > cpu_backend.GROUPED_MAX_ROWS_PER_EXPERT * 4
    backend = CpuBackend(dtype)
    ex = _experts(4, dtype)
    x, ids, weights = _routing(100, 4, 2, seed=7)
    before = _check(backend, ex, x, ids, weights, dtype)
    chosen = sorted(set(ids.flatten().tolist()))
    if backend.weights.usable(dtype) is not None:
        assert all(backend.weights.packed(ex.expert(e)[0]) for e in chosen)
        assert not any(backend.weights.packed(ex.expert(e)[0]) for e in (2, 3))   # nobody chose them
    with torch.no_grad():
        ex.gate_up_proj.mul_(-1.5)                                     # in place: same storage
    after = _check(backend, ex, x, ids, weights, dtype)
    assert not torch.allclose(before.double(), after.double(), atol=1e-2)
    ex.down_proj.data = _experts(4, dtype, seed=3).down_proj.data      # a trainer's swapped storage
    _check(backend, ex, x, ids, weights, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_reads_the_weights_as_they_are_now(dtype):
    """A decode step after an update of the stacked weights sees the update."""
    backend, ex = CpuBackend(dtype), _experts(16, dtype)
    x, ids, weights = _routing(1, 16, 2, seed=1)
    _check(backend, ex, x, ids, weights, dtype)
    with torch.no_grad():
        ex.down_proj.copy_(_experts(16, dtype, seed=5).down_proj)
    _check(backend, ex, x, ids, weights, dtype)


def test_an_expert_id_out_of_range_is_refused():
    kernel = grouped_experts(torch.float32)
    if kernel is None:
        return
    ex = _experts(4, torch.float32)
    x = torch.randn(2, HIDDEN)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(x, torch.tensor([[0, 4], [1, 2]]), torch.ones(2, 2), *ex.stacked())
