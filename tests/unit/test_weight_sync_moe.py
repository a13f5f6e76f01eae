"""Trainer pushes of a mixture's weights under SGLang's names (experts.N.gate_proj /
up_proj / down_proj, Mixtral's block_sparse_moe.experts.N.w1 / w3 / w2, the router
mlp.gate, GLM's e_score_correction_bias and shared experts), broadcast one by one or
as slime's flat bucket, or as update_weights_from_tensor's payload: the workers'
weights become a fresh load of the new checkpoint (parameters, logits, greedy
tokens). Each expert's tensor is a row range of the stacked parameters
(engines/models/moe.py), so a push of some experts changes only their rows."""
from __future__ import annotations

import pytest
import torch

from engines.formats.weights import apply_checkpoint, checked_placement
from engines.loader import load_model
from tests.unit.inproc import InprocCluster
from tests.unit.test_gguf_moe import run_greedy
from tests.unit.test_tensor_payload import flattened, serialize
from tests.unit.test_weight_sync import admin, join, push
from tests.unit.trainer_side import Trainer

pytest.importorskip("transformers", reason="transformers writes the random checkpoints")

PROMPT = [5, 77, 123, 9, 250, 31, 64]
LONG = PROMPT * 4          # a prefill whose experts take 2 to 16 rows: packed float32 copies


def _state(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state |= load_file(f)
    return state


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (the checkpoint the cluster loads, the one pushed)."""
    from tests.unit.hf_models import make_checkpoint
    root = tmp_path_factory.mktemp("moe")
    return {kind: (make_checkpoint(kind, root, seed=0), make_checkpoint(kind, root, seed=1))
            for kind in ("mixtral", "glm4_moe", "qwen3_moe")}


@pytest.fixture
def trainer():
    t = Trainer(world_size=3)
    yield t
    t.close()


def _is_fresh_load(c: InprocCluster, want, prompt: list[int] = PROMPT) -> None:
    """Every worker's parameters, logits and greedy tokens are model `want`'s."""
    params = dict(want.net.named_parameters())
    for core in (c.prefill, c.decode):
        for n, p in core.model.net.named_parameters():
            assert torch.equal(p, params[n]), n
    rid = c.submit(prompt, 8)         # first: the workers' packed copies, if stale, are used
    assert c.run(rid).token_ids == run_greedy(want, prompt, 8)[0]
    want_tokens, want_logits = run_greedy(want, prompt, 6)
    for core in (c.prefill, c.decode):    # the prefill's logits: through its packed copies
        tokens, logits = run_greedy(core.model, prompt, 6)
        assert tokens == want_tokens and all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    c.check_pages()


@pytest.mark.parametrize("kind,bucket", [("mixtral", False), ("glm4_moe", True)])
def test_a_push_of_every_tensor_is_a_fresh_load(checkpoints, trainer, kind, bucket):
    old, new = checkpoints[kind]
    c = InprocCluster(kv_cache_mb=2.0, model=str(old))
    try:
        c.run(c.submit(PROMPT, 4))
        assert join(c, trainer)["ok"]
        tensors = _state(new)
        assert any(".experts.3." in n for n in tensors)
        reply = push(c, trainer, tensors, version="v2", bucket=bucket)
        assert reply["ok"] and reply["weight_version"] == "v2", reply
        _is_fresh_load(c, load_model(str(new), dtype="float64"))
    finally:
        c.close()


def test_update_weights_from_tensor_with_a_flat_bucket_of_experts(checkpoints):
    """update_weights_from_tensor in SGLang's flattened_bucket form, in two buckets."""
    import torch.multiprocessing as mp
    old, new = checkpoints["qwen3_moe"]
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    c = InprocCluster(kv_cache_mb=2.0, model=str(old))
    try:
        tensors = list(_state(new).items())
        for half in (tensors[:len(tensors) // 2], tensors[len(tensors) // 2:]):
            reply = admin(c, "update_weights_from_tensor", load_format="flattened_bucket",
                          serialized_named_tensors=[serialize(flattened(dict(half)))],
                          weight_version="t1")
            assert reply["ok"], reply
        _is_fresh_load(c, load_model(str(new), dtype="float64"))
    finally:
        c.close()
        mp.set_sharing_strategy(before)


def test_a_push_of_some_experts_changes_only_their_rows(checkpoints, trainer, monkeypatch):
    """The experts of layer 1 the prefill has packed float32 copies of, and GLM's router
    bias of layer 2: their rows change, the rest stay, and no stale packed copy is used
    (the same experts are chosen again: the router and layer 0 did not change). The
    prompt goes through torch's grouped loop, whose products use the packed copies (the
    experts kernel, which takes short prompts, reads the plain weights)."""
    import engines.cpu.backend as cpu_backend
    monkeypatch.setattr(cpu_backend, "GROUPED_MAX_ROWS_PER_EXPERT", 0)
    old, new = checkpoints["glm4_moe"]
    c = InprocCluster(kv_cache_mb=2.0, model=str(old), dtype="float32")
    try:
        c.run(c.submit(LONG, 4))
        experts = c.prefill.model.net.model.layers[1].mlp.experts
        packed = [e for e in range(experts.num) if hasattr(experts.expert(e)[0], "_zpd_packed")]
        assert packed and len(packed) < experts.num
        assert join(c, trainer)["ok"]
        part = {n: t for n, t in _state(new).items()
                if any(f".layers.1.mlp.experts.{e}." in n for e in packed)
                or n.endswith("layers.2.mlp.gate.e_score_correction_bias")}
        assert len(part) == 3 * len(packed) + 1
        assert push(c, trainer, part, version="some")["ok"]
        want = load_model(str(old))
        params = dict(want.net.named_parameters())
        apply_checkpoint(want.net, [(checked_placement(want.net, params, n, t.shape), lambda t=t: t)
                                    for n, t in part.items()])
        gate_up = "model.layers.1.mlp.experts.gate_up_proj"
        assert not torch.equal(params[gate_up], load_model(str(old)).net.get_parameter(gate_up))
        _is_fresh_load(c, want, LONG)
    finally:
        c.close()


def test_an_expert_the_model_lacks_is_refused_by_name(checkpoints, trainer):
    old, new = checkpoints["mixtral"]
    c = InprocCluster(kv_cache_mb=2.0, model=str(old))
    try:
        assert join(c, trainer)["ok"]
        name = "model.layers.0.block_sparse_moe.experts.4.w1.weight"       # 4 experts: 0..3
        reply = push(c, trainer, {name: torch.zeros(96, 64)})
        assert not reply["ok"] and all(w["status"] == 400 and "does not belong" in w["error"]
                                       and "experts.4.w1" in w["error"] for w in reply["workers"])
        reply = push(c, trainer, {"model.layers.0.block_sparse_moe.experts.1.w2.weight": torch.zeros(96, 64)})
        assert not reply["ok"] and all("has shape (96, 64), the model expects (64, 96)" in w["error"]
                                       for w in reply["workers"]), reply
        _is_fresh_load(c, load_model(str(old), dtype="float64"))
    finally:
        c.close()
