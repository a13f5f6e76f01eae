"""The offline engine (`zpd run`'s path), weight updates and bad input."""
from __future__ import annotations

import json

import pytest
import torch

from engines.allocator_tuning import freeze_startup_objects, tune_allocator
from engines.config import ModelError
from engines.cpu.linear import PackedWeights
from engines.loader import load_model, update_weights
from engines.sampler import SamplingParams
from engines.models.tiny import save_tiny
from engines.offline import OfflineEngine
from engines.request import Request, Unservable
from engines.torch_backend import group_by_length

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def _run(model, prompts, params=GREEDY, **kw):
    engine = OfflineEngine(model, **kw)
    return engine, engine.run([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])


@pytest.fixture(scope="module")
def tiny64():
    return load_model("tiny", dtype="float64")


PROMPTS = [[1], list(range(2, 20)), list(range(50, 90)), [7, 7, 7], list(range(100, 133))]


def test_batch_equals_each_prompt_alone(tiny64):
    _, together = _run(tiny64, PROMPTS, max_batch=2)       # admission in waves
    for p, out in zip(PROMPTS, together):
        _, (alone,) = _run(tiny64, [p])
        assert alone["output_ids"] == out["output_ids"]
        assert len(out["output_ids"]) == 12 and out["finish_reason"] == {"type": "length"}


def test_small_pool_back_pressure_still_serves_everything(tiny64):
    # room for about two requests at a time: the rest wait for pages
    engine, outs = _run(tiny64, PROMPTS, kv_cache_mb=tiny64_pages_mb(tiny64, 8))
    _, ref = _run(tiny64, PROMPTS)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    engine.pool.allocator.check()
    assert engine.pool.allocator.free == engine.pool.num_pages


def tiny64_pages_mb(model, pages):
    from engines.kv.layout import KVLayout
    return pages * KVLayout.for_model(model.cfg, 16, model.dtype).page_bytes / 2**20


def test_seeded_sampling_is_reproducible_across_batches(tiny64):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_new_tokens=10, ignore_eos=True)
    _, a = _run(tiny64, PROMPTS, params)
    _, b = _run(tiny64, PROMPTS[2:3], params)
    assert a[2]["output_ids"] == b[0]["output_ids"]


def test_stop_token_ids_and_stop_strings(tiny64):
    _, (free,) = _run(tiny64, [PROMPTS[1]])
    stop_at = free["output_ids"][3]
    _, (out,) = _run(tiny64, [PROMPTS[1]], SamplingParams(temperature=0, max_new_tokens=12,
                                                          stop_token_ids=(stop_at,), ignore_eos=True))
    first = free["output_ids"].index(stop_at)
    assert out["output_ids"] == free["output_ids"][:first + 1]
    assert out["finish_reason"] == {"type": "stop", "matched": stop_at}
    text = free["text"]
    needle = next(text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].isprintable()
                  and "\ufffd" not in text[i:i + 2])
    _, (cut,) = _run(tiny64, [PROMPTS[1]], SamplingParams(temperature=0, max_new_tokens=12,
                                                          stop=(needle,), ignore_eos=True))
    assert cut["finish_reason"]["matched"] == needle
    assert cut["text"] == text[:text.index(needle)]


def test_eos_ends_unless_ignored(tiny64):
    eos = tiny64.cfg.eos_token_ids[0]
    prompts = [[i] for i in range(40)]
    _, outs = _run(tiny64, prompts, SamplingParams(temperature=0, max_new_tokens=30))
    stopped = [o for o in outs if o["finish_reason"]["type"] == "stop"]
    assert stopped and all(o["output_ids"][-1] == eos for o in stopped)


def test_weight_update_equals_fresh_load(tmp_path):
    model = load_model("tiny", dtype="float64")
    _, before = _run(model, PROMPTS)
    new_dir = save_tiny(tmp_path / "w2", seed=5)
    assert update_weights(model, str(new_dir), "v2") == "v2"
    _, after = _run(model, PROMPTS)
    _, fresh = _run(load_model(str(new_dir), dtype="float64"), PROMPTS)
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in fresh]
    assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]
    assert after[0]["weight_versions"] == ["v2"] * 12


def test_float32_layout_is_kept_through_updates(tmp_path):
    """float32 projection and head weights are row-major where the float32 product
    kernel runs (engines/cpu/products.py) and column-major where it does not (faster
    with F.linear); a weight update copies into them and keeps either layout, with
    the values of a fresh load. bfloat16 is row-major."""
    from engines.cpu.products import small_linear
    model = load_model("tiny", dtype="float32")
    kernel = small_linear(torch.float32) is not None
    assert all(w.is_contiguous() == kernel for w in model.net.linears())
    other = load_model("tiny", dtype="float32")
    if kernel:
        other.net.column_major_float32()             # the layout without the kernel
    new_dir = save_tiny(tmp_path / "w2", seed=5)
    fresh = dict(load_model(str(new_dir), dtype="float32").net.named_parameters())
    for m in (model, other):
        before = [w.is_contiguous() for w in m.net.linears()]
        update_weights(m, str(new_dir), "v2")
        assert all(torch.equal(p, fresh[n]) for n, p in m.net.named_parameters())
        assert [w.is_contiguous() for w in m.net.linears()] == before
    assert not any(w.is_contiguous() for w in other.net.linears())
    assert all(w.is_contiguous() for w in load_model("tiny", dtype="bfloat16").net.linears())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_follow_every_update(tmp_path, dtype):
    """The packed copies (engines/cpu/linear.py) are rebuilt after a weight update: the
    updated model answers as a fresh load of the new weights does. Ten prompts make
    decode batches of ten rows, which both dtypes multiply packed (products of up to
    8 rows go to engines/cpu/products.py instead)."""
    prompts = PROMPTS + [[t + 1 for t in p] for p in PROMPTS]
    model = load_model("tiny", dtype=dtype)
    _, before = _run(model, prompts)
    packed = PackedWeights()
    usable = packed.usable(model.dtype) is not None
    assert all(packed.packed(w) for w in model.net.linears()) == usable
    new_dir = save_tiny(tmp_path / "w2", seed=5)
    update_weights(model, str(new_dir), "v2")
    assert not any(packed.packed(w) for w in model.net.linears())     # stale: not used
    _, after = _run(model, prompts)
    _, fresh = _run(load_model(str(new_dir), dtype=dtype), prompts)
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in fresh]
    assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]


@pytest.mark.parametrize("dtype,rows", [(torch.bfloat16, 1), (torch.bfloat16, 16),
                                        (torch.bfloat16, 256), (torch.bfloat16, 257),
                                        (torch.float32, 1), (torch.float32, 2),
                                        (torch.float32, 7), (torch.float32, 16), (torch.float32, 17)])
def test_packed_products_equal_plain_ones(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.nn.Parameter((torch.randn(96, 64, generator=g) * 0.1).to(dtype), requires_grad=False)
    if dtype == torch.float32:
        w.data = w.data.t().contiguous().t()          # as the model holds it
    x, b = torch.randn(rows, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    packed = PackedWeights()
    for bias in (None, b):
        got = packed.linear(x, w, bias).double()
        assert torch.allclose(got, want - (b.double() if bias is None else 0), atol=0.05, rtol=0.02)
    packing = packed.usable(dtype)
    from engines.cpu.products import SmallLinear, small_linear
    kernel = rows <= SmallLinear.ROWS and small_linear(dtype) is not None and w.is_contiguous()  # no copy
    packs = packing is not None and packing.rows[0] <= rows <= packing.rows[1]
    assert packed.packed(w) == (packs and (packing.before_small or not kernel))
    assert packed.usable(torch.float64) is None


def test_a_packing_that_disagrees_or_fails_gives_plain_products(monkeypatch, caplog):
    """A torch whose packed product is wrong, or whose ops are missing, is found out by
    the first-use check: products stay F.linear's, with a warning."""
    import engines.cpu.linear as lin

    def missing(w):
        raise RuntimeError("no such op")
    wrong = lin.Packing("wrong", (1, 16), lambda w: w, lambda x, p, w, b: torch.zeros(x.shape[0], w.shape[0]))
    broken = lin.Packing("broken", (1, 16), missing, lambda x, p, w, b: x)
    monkeypatch.setattr(lin, "PACKINGS", {torch.float32: wrong, torch.bfloat16: broken})
    monkeypatch.setattr(lin, "_kernel_packing", lambda dtype: None)   # (own check: test_cpu_kernels)
    packed = lin.PackedWeights()
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.nn.Parameter(torch.randn(8, 4).to(dtype), requires_grad=False)
        x = torch.randn(12, 4).to(dtype)     # past the small-batch kernel's rows
        assert torch.equal(packed.linear(x, w), torch.nn.functional.linear(x, w))
        assert packed.usable(dtype) is None and not packed.packed(w)
    assert "wrong packing" in caplog.text and "disagrees" in caplog.text
    assert "broken packing" in caplog.text and "no such op" in caplog.text


def test_packed_copies_can_be_turned_off(caplog):
    """Switched off (ZPD_PACKED_WEIGHTS=0, a memory-tight host): no copy is made, and
    products are F.linear's."""
    import engines.cpu.linear as lin
    packed = lin.PackedWeights(enabled=False)
    with caplog.at_level("INFO", "zpd.engine"):
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.nn.Parameter(torch.randn(8, 4).to(dtype), requires_grad=False)
            x = torch.randn(12, 4).to(dtype)         # rows that packings take
            assert torch.equal(packed.linear(x, w), torch.nn.functional.linear(x, w))
            assert packed.usable(dtype) is None and not packed.packed(w)
    assert "switched off" in caplog.text
    on = lin.PackedWeights()                                  # on by default
    w = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
    on.linear(torch.randn(12, 4), w)
    assert on.packed(w) == (on.usable(torch.float32) is not None)


def test_mismatched_checkpoint_keeps_old_weights(tmp_path):
    model = load_model("tiny", dtype="float64")
    _, before = _run(model, PROMPTS)
    bad = save_tiny(tmp_path / "bad", seed=1)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="architecture differs"):
        update_weights(model, str(bad))
    from safetensors.torch import load_file, save_file
    good = save_tiny(tmp_path / "partial", seed=2)
    sd = load_file(good / "model.safetensors")
    sd.pop("model.norm.weight")
    save_file(sd, good / "model.safetensors")
    with pytest.raises(ModelError, match="lacks"):
        update_weights(model, str(good))
    _, after = _run(model, PROMPTS)
    assert after == before and model.version == "tiny"


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(ModelError, match="neither 'tiny', 'smollm2', 'null', a .gguf file nor an existing directory"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path))
    d = save_tiny(tmp_path / "corrupt")
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelError, match="corrupt"):
        load_model(str(d))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"],
                                                     "model_type": "gpt2"}))
    with pytest.raises(ModelError, match="supported: LlamaForCausalLM"):
        load_model(str(d))
    with pytest.raises(ModelError, match="unsupported dtype"):
        load_model("tiny", dtype="int8")


@pytest.mark.parametrize("prompt,params,match", [
    ([], GREEDY, "empty prompt"),
    ([258], GREEDY, "out of range"),
    ([-1], GREEDY, "out of range"),
    ([1] * 4000, SamplingParams(max_new_tokens=200), "exceeds the context length"),
])
def test_bad_requests_are_rejected_and_engine_keeps_serving(tiny64, prompt, params, match):
    engine = OfflineEngine(tiny64)
    with pytest.raises(Unservable, match=match) as e:
        engine.submit(Request("bad", prompt, params))
    assert e.value.status == 400
    (out,) = engine.run([Request("ok", [1, 2, 3], GREEDY)])
    assert len(out["output_ids"]) == 12
    assert engine.pool.allocator.free == engine.pool.num_pages


def test_text_prompt_without_tokenizer_is_clear_error(tmp_path, capsys):
    from zpd.ops.cli import main
    d = save_tiny(tmp_path / "notok")
    (d / "tokenizer.json").unlink()
    assert main(["run", "--model", str(d), "--prompt", "hi"]) == 2
    assert "has no tokenizer.json: use --input-ids" in capsys.readouterr().err
    assert main(["run", "--model", str(d), "--input-ids", "1,2", "--max-new-tokens", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] is None and len(out["output_ids"]) <= 3


def test_dtypes_run(tmp_path):
    for dtype in ("float32", "bfloat16", "float16"):
        model = load_model("tiny", dtype=dtype)
        _, (out,) = _run(model, [PROMPTS[1]])
        assert len(out["output_ids"]) == 12
        assert all(0 <= t < model.cfg.vocab_size for t in out["output_ids"])
    assert torch.get_default_dtype() == torch.float32


def test_group_by_length_bounds_padding():
    assert group_by_length([10, 300, 160, 12, 150, 5]) == [[1, 2, 4], [3, 0], [5]]
    assert group_by_length([7, 7, 7]) == [[0, 1, 2]]
    groups = group_by_length([1, 3, 7, 15, 31, 63])
    assert all(len(g) == 1 for g in groups) and len(groups) == 6    # each more than twice the next


@pytest.mark.parametrize("lengths", [[3, 300, 40], [20, 30, 25], [20 + i for i in range(12)]],
                         ids=["three groups", "one group", "a group past the fused kernel's rows"])
def test_decode_of_mixed_lengths_equals_each_alone(tiny64, lengths):
    """Logits of one decode step over contexts of different lengths (in three length
    groups, or in one whose rows are not in length order, or in one of more rows than
    attend with the fused kernel) equal each sequence's step alone."""
    engine = OfflineEngine(tiny64, max_batch=len(lengths))
    runner, pool = engine.compute.runner, engine.compute.pool
    tables = [pool.allocator.alloc(pool.pages_for(n + 1)) for n in lengths]
    prompts = [[(7 * n + i) % 200 + 1 for i in range(n)] for n in lengths]
    runner.prefill(prompts, tables)
    tokens, positions = [5 + i for i in range(len(lengths))], lengths
    together = runner.decode(tokens, positions, tables)
    for i in range(len(lengths)):
        alone = runner.decode([tokens[i]], [positions[i]], [tables[i]])
        torch.testing.assert_close(together[i], alone[0], rtol=1e-12, atol=1e-12)


def test_the_allocator_settings_apply_on_glibc():
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert tune_allocator()


def test_start_up_objects_are_frozen_out_of_the_collector():
    import gc
    before = gc.get_freeze_count()
    try:
        frozen = freeze_startup_objects()
        # frozen objects that another thread frees meanwhile leave the count (a full
        # run's leftover threads freed 2 once)
        assert frozen > before and 0 <= frozen - gc.get_freeze_count() < 1_000
        assert len(gc.get_objects()) < frozen      # what is left to scan is what came after
    finally:
        gc.unfreeze()


def test_a_copy_made_by_another_packing_is_not_used():
    """A weight's packed copy remembers the packing that made it: when the packing in
    use changes (the kernels switched on or off in one process), the copy is rebuilt
    instead of being read in the wrong layout."""
    import engines.cpu.linear as lin
    doubled = lin.Packing("doubled", (1, 16), lambda w: w * 2, lambda x, p, w, b: torch.nn.functional.linear(x, p) / 2)
    negated = lin.Packing("negated", (1, 16), lambda w: -w, lambda x, p, w, b: -torch.nn.functional.linear(x, p))
    packed = lin.PackedWeights()
    w = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
    x = torch.randn(12, 4)                                   # past the small-batch kernel's rows
    want = torch.nn.functional.linear(x, w)
    for packing in (doubled, negated, doubled):
        packed._usable[torch.float32] = packing
        torch.testing.assert_close(packed.linear(x, w), want)
        assert packed.packed(w) and getattr(w, packed.ATTR)[0][2] == packing.name


def test_float32_panels_take_prefills_only_off_intel(monkeypatch, tmp_path):
    """The float32 panel kernel stops at 64 rows on an Intel CPU (MKL's GEMM is as
    fast past that) and takes every size from 9 on others (MKL's generic path there
    is slower); an unreadable /proc/cpuinfo counts as Intel's, the measured default."""
    import engines.cpu.linear as lin
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(lin, "Path", lambda _: info)
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n")
    assert lin._panel_max_rows() == 64
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n")
    assert lin._panel_max_rows() >= 1 << 20
    info.unlink()
    assert lin._panel_max_rows() == 64


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_torch_backend_gives_the_cpu_backends_answers(dtype):
    """The reference backend (engines/torch_backend.py, what CUDA runs) on CPU: a
    prefill, a prefill after a cached prefix and decode steps give the CPU backend's
    greedy tokens and logits to float32 rounding; in float64, where no CPU kernel
    runs, the same bits."""
    from engines.kv.layout import KVLayout
    from engines.kv.pool import KVPool
    from engines.runner import ModelRunner
    from engines.torch_backend import TorchBackend
    model = load_model("tiny", dtype=dtype)
    pool = KVPool(KVLayout.for_model(model.cfg, 16, model.dtype), 64, model.dtype, model.device)
    prompts = [p for p in PROMPTS if len(p) > 3]
    tables = [[pool.allocator.alloc(pool.pages_for(len(p) + 4)) for p in prompts] for _ in range(2)]

    def answers(runner, tables):
        runner.prefill([p[:3] for p in prompts], tables[1])
        out = [runner.prefill(prompts, tables[0]), runner.prefill(prompts, tables[1], [3] * len(prompts))]
        seqs = [list(p) for p in prompts]
        for _ in range(4):
            for s, t in zip(seqs, out[-1].argmax(-1).tolist()):
                s.append(t)
            out.append(runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs], tables[0]))
        return seqs, out

    cpu, reference = ModelRunner(model, pool), ModelRunner(model, pool)
    reference.backend = TorchBackend()
    (cpu_seqs, cpu_logits), (ref_seqs, ref_logits) = answers(cpu, tables), answers(reference, tables)
    assert cpu_seqs == ref_seqs
    for got, want in zip(ref_logits, cpu_logits):
        if dtype == "float64":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
