"""The CPU library (engines/cpu/kernels.py): decode attention against a float64
reference and torch's path, its refusal of rows outside the pool, and how the library
is built, cached and given up on. Products: test_cpu_products.py; layer steps:
test_cpu_layer_ops.py."""
from __future__ import annotations

import logging

import pytest
import torch

import engines.cpu.kernels as pd
from engines.loader import load_model
from engines.offline import OfflineEngine

from tests.unit.cpu_support import require_compiler

require_compiler()


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
    assert runner.backend.paged_decode is not None
    lengths = [3, 300, 40]
    tables = [pool.allocator.alloc(pool.pages_for(n + 1)) for n in lengths]
    runner.prefill([[(7 * n + i) % 200 + 1 for i in range(n)] for n in lengths], tables)
    with_kernel = runner.decode([5, 6, 7], lengths, tables).double()
    runner.backend.paged_decode = None
    with_torch = runner.decode([5, 6, 7], lengths, tables).double()
    torch.testing.assert_close(with_kernel, with_torch, rtol=0, atol=tol)


def test_float64_and_other_devices_use_torch_attention():
    assert pd.kernel_for(torch.float64, "cpu") is None
    assert pd.kernel_for(torch.float32, "cuda") is None
    assert OfflineEngine(load_model("tiny", dtype="float64")).compute.runner.backend.paged_decode is None


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


def test_one_source_failing_fails_the_build_and_leaves_nothing(fresh, tmp_path):
    """The sources compile side by side; one that fails (here the products) fails the
    build with its compiler's complaint, and no library is left in the cache."""
    import shutil
    compiler = tmp_path / "cxx"
    compiler.write_text(f"""#!/bin/sh
case "$*" in *products.cpp*) echo "boom in products" >&2; exit 1;; esac
exec {shutil.which("g++")} "$@"
""")
    compiler.chmod(0o755)
    fresh.setenv("CXX", str(compiler))
    (tmp_path / "kernels").mkdir()
    with pytest.raises(RuntimeError, match="products.cpp.*boom in products"):
        pd.build(tmp_path / "kernels")
    assert not list((tmp_path / "kernels").iterdir())


def test_a_build_past_its_time_limit_fails_and_its_compilers_are_killed(fresh, tmp_path):
    """The sources' compilers share one deadline (BUILD_TIMEOUT_S); past it the build
    fails with a RuntimeError (the engine then stays on torch's path), the compilers
    still running are killed rather than waited for, and nothing is left in the cache."""
    import time
    compiler = tmp_path / "cxx"
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && exec echo slow 1.0\nexec sleep 60\n')
    compiler.chmod(0o755)
    fresh.setenv("CXX", str(compiler))
    fresh.setattr(pd, "BUILD_TIMEOUT_S", 1)
    (tmp_path / "kernels").mkdir()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="took over 1 s"):
        pd.build(tmp_path / "kernels")
    assert time.monotonic() - started < 10             # the 60 s compilers were not waited for
    assert not list((tmp_path / "kernels").iterdir())


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
    assert engine.compute.runner.backend.paged_decode is None
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
