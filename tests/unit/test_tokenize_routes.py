"""/tokenize, /detokenize (and their /v1/ names) and /ping in SGLang's shapes, over a
fake router: the ids are the ones the tiny model's tokenizer gives the workers."""
from __future__ import annotations

import pytest

from engines.models.tiny import tiny_tokenizer
from tests.unit.http_fake import FakeBackend, call, front

TOK = tiny_tokenizer()
STATUS = {"ok": True, "workers": [{"ok": True, "role": "decode", "endpoint": "d:1",
                                   "context_length": 2048, "weight_version": "v1"}]}


def cluster():
    return front(FakeBackend(replies={"status": STATUS}))


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_tokenize_answers_sglangs_fields(path):
    status, got = call(cluster(), "POST", path, {"model": "tiny", "prompt": "Hi there"})
    assert status == 200, got
    assert got == {"tokens": TOK.encode("Hi there"), "count": len(TOK.encode("Hi there")),
                   "max_model_len": 2048}
    status, got = call(cluster(), "POST", path, {"prompt": ["a", "bc"], "add_special_tokens": False})
    assert status == 200 and got["tokens"] == [TOK.encode("a", False), TOK.encode("bc", False)]
    assert got["count"] == [len(t) for t in got["tokens"]]


def test_tokenize_without_the_router_still_answers():
    down = front(FakeBackend(replies={"status": {"ok": False, "status": 504, "error": "no answer"}}))
    status, got = call(down, "POST", "/tokenize", {"prompt": "x"})
    assert status == 200 and got["max_model_len"] == -1 and got["tokens"] == TOK.encode("x")


@pytest.mark.parametrize("path", ["/detokenize", "/v1/detokenize"])
def test_detokenize_answers_text(path):
    ids = TOK.encode("Hello, world", add_special_tokens=False)
    status, got = call(cluster(), "POST", path, {"tokens": ids})
    assert status == 200 and got == {"text": "Hello, world"}
    status, got = call(cluster(), "POST", path, {"tokens": [ids, ids[:1]]})
    assert status == 200 and got["text"] == ["Hello, world", TOK.decode(ids[:1])]
    assert call(cluster(), "POST", path, {"tokens": []}) == (200, {"text": ""})


@pytest.mark.parametrize("path, body, words", [
    ("/tokenize", {}, "'prompt' is required"),
    ("/tokenize", {"prompt": 5}, "'prompt' must be a string"),
    ("/tokenize", {"prompt": ["a", 3]}, "'prompt[1]' must be a string"),
    ("/tokenize", {"prompt": []}, "empty list"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {}, "'tokens' must be a list"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens[1]"),
    ("/detokenize", {"tokens": [[1], ["x"]]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": 0}, "skip_special_tokens"),
])
def test_bad_bodies_are_400_naming_the_field(path, body, words):
    status, got = call(cluster(), "POST", path, body)
    assert status == 400 and words in got["error"]["message"], got


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_health_and_needs_no_key(method):
    keyed = front(FakeBackend(replies={"status": STATUS}), api_key="k")
    assert call(keyed, method, "/ping")[0] == 200
    assert call(keyed, "POST", "/tokenize", {"prompt": "x"})[0] == 401
    down = front(FakeBackend(replies={"status": {"ok": True, "workers": []}}))
    assert call(down, method, "/ping")[0] == 503
