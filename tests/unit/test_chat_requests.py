"""Conversations sent to a cluster (`Generate.chat`, `zpd generate --chat`): the workers
render them with the model's chat template and serve them like `zpd run --chat`; a
malformed conversation, or one for a model without a template, is a clear 400 that
changes nothing else (tests/unit/inproc.py, tests/unit/gguf_files.py)."""
from __future__ import annotations

import pytest

from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.unit.gguf_files import write_tiny_gguf
from tests.unit.inproc import InprocCluster
from zpd.limits import PromptLimits
from zpd.ops.cli import main
from zpd.router.shares import request_tokens
from zpd.wire.protocol import Generate

GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
TURN = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def chat_cluster(tmp_path):
    """The tiny model from a GGUF file, which carries a chatml template."""
    c = InprocCluster(model=str(write_tiny_gguf(tmp_path / "tiny.gguf")))
    yield c
    c.close()


def offline(model, prompt: list[int]) -> list[int]:
    params = GREEDY
    return OfflineEngine(model, kv_cache_mb=1).run([Request("r", prompt, params)])[0]["output_ids"]


def test_a_conversation_is_served_as_zpd_run_serves_it(chat_cluster):
    c = chat_cluster
    c.client.send(Generate("chat", [], GREEDY, True, chat={"messages": TURN}))
    got = c.run("chat")
    prompt = c.prefill.model.encode_chat(TURN)
    assert c.prefill.model.tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert got.finish["type"] == "length" and got.meta["prompt_tokens"] == len(prompt)
    assert got.token_ids == offline(c.prefill.model, prompt)
    c.check_pages()


@pytest.mark.parametrize("chat,why", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": [{"role": 3, "content": "x"}]}, "role"),
    ({"messages": [["user", "hi"]]}, "message"),
    ({"messages": TURN, "documents": []}, "chat must be"),
    ({"messages": TURN, "tools": "all"}, "tools must be a list of objects"),
    ({"messages": TURN, "chat_template_kwargs": {"messages": []}}, "set by the server"),
    ({"messages": TURN, "chat_template_kwargs": [1]}, "must be an object"),
    ({"turns": TURN}, "chat must be"),
])
def test_a_malformed_conversation_is_a_400(chat_cluster, chat, why):
    c = chat_cluster
    c.client.send(Generate("bad", [], GREEDY, chat=chat))
    got = c.run("bad")
    assert got.status == 400 and why in got.finish["message"], got.finish
    c.pump()
    c.check_pages()
    c.client.send(Generate("good", [], GREEDY, chat={"messages": TURN}))
    assert c.run("good").finish["type"] == "length"


def test_a_template_that_raises_is_a_400(chat_cluster):
    c = chat_cluster
    for core in (c.prefill, c.decode):
        core.model.chat.__init__("{{ raise_exception('only user turns, please') }}", None, None)
    c.client.send(Generate("r", [], GREEDY, chat={"messages": TURN}))
    got = c.run("r")
    assert got.status == 400 and "only user turns, please" in got.finish["message"]
    c.serves_again([1, 2, 3])


def test_a_model_without_a_template_names_the_problem(cluster):
    cluster.client.send(Generate("r", [], GREEDY, chat={"messages": TURN}))
    got = cluster.run("r")
    assert got.status == 400 and "no chat template" in got.finish["message"]
    cluster.serves_again()


def test_conversations_are_capped_and_charged_as_json():
    big = {"messages": [{"role": "user", "content": "é" * 600}]}
    assert "max-text-bytes" in PromptLimits(max_text_bytes=1000).refusal([], "", big)
    assert PromptLimits(max_text_bytes=2000).refusal([], "", big) is None
    charged = request_tokens(Generate("r", [], SamplingParams(max_new_tokens=10), chat=big))
    assert charged >= 1200 + 10     # the UTF-8 bytes at least, and the template's allowance


def test_zpd_run_chat_prints_the_answer(tmp_path, capsys):
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert main(["run", "--model", path, "--chat", "--prompt", "Hello there", "--json",
                 "--temperature", "0", "--max-new-tokens", "6", "--ignore-eos"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    from engines.loader import load_model
    model = load_model(path, dtype="float32")
    assert out["output_ids"] == offline(model, model.encode_chat(TURN))
    assert out["meta"]["prompt_tokens"] == len(model.encode_chat(TURN))
