"""The in-process cluster (tests/unit/inproc.py) as a fixture, one per test, and other
fixtures shared by unit tests."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from engines.loader import load_model, resolve_spec
from tests.unit.gguf_files import gguf_meta
from tests.unit.inproc import InprocCluster


@pytest.fixture
def dead_endpoint() -> str:
    """An address on loopback where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The CPU kernels looked up again under the test's settings (built in a cache of
    their own), and the default settings back after."""
    from engines.cpu import kernels as cpu_kernels
    cpu_kernels.configure(True, tmp_path / "kernels")
    yield monkeypatch
    monkeypatch.undo()
    cpu_kernels.configure()


@pytest.fixture
def cluster():
    c = InprocCluster()
    yield c
    c.close()


# SmolLM2's GGUF file (`--model smollm2`), read once for every test module that needs it.


@pytest.fixture(scope="session")
def smollm_meta() -> dict:
    return gguf_meta(Path(resolve_spec("smollm2")))


@pytest.fixture(scope="session")
def smollm(smollm_meta):
    """Our tokenizer for the file."""
    from engines.formats.vocab import tokenizer_from_gguf
    return tokenizer_from_gguf(smollm_meta)


@pytest.fixture(scope="session")
def smollm_ref():
    """transformers' tokenizer for the same file: the reference."""
    import transformers
    path = Path(resolve_spec("smollm2"))
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_gguf():
    """transformers' model from the file: dequantized weights, float32 kernels. It is
    the test-time reference; it needs `gguf` and `accelerate` to read the file."""
    transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")
    path = Path(resolve_spec("smollm2"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf64(hf_gguf):
    """The same weights in transformers' plain Llama, computing in float64."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_config(hf_gguf.config).to(torch.float64)
    model.load_state_dict(hf_gguf.state_dict())
    return model.eval()


@pytest.fixture(scope="module")
def ours64():
    """Our model from the file, in float64."""
    return load_model("smollm2", dtype="float64")
