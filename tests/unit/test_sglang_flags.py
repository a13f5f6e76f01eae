"""SGLang's launch flags on zpd's commands (issue 29, item 6): each is honoured exactly
where zpd has the concept, or refused with an error naming it; none is ignored."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from engines.formats.chat import ChatTemplate
from engines.config import ModelError
from engines.loader import load_model
from engines.text import load_text
from engines.formats.overrides import ModelOverrides
from engines.models.tiny import TINY_CONFIG, tiny_tokenizer
from tests.unit.gguf_files import CHATML, write_tiny_gguf
from zpd.config import HttpConfig, WorkerConfig
from zpd.worker import mem_fraction
from zpd.ops.cli import build_parser, main
from zpd.ops.http_options import HTTP_PASSTHROUGH, http_config
from zpd.ops.options import passthrough_argv, worker_argv, worker_config

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}>"
HI = [{"role": "user", "content": "hi"}]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.mark.parametrize("command", ["run", "prefill", "decode", "launch", "http"])
def test_model_path_is_model(command: str) -> None:
    assert parse(command, "--model-path", "tiny").model == "tiny"


def test_the_flags_reach_the_worker_config() -> None:
    args = parse("decode", "--model-path", "tiny", "--tokenizer-path", "/t", "--chat-template",
                 "/c.jinja", "--context-length", "64", "--mem-fraction-static", "0.5")
    cfg = worker_config(args, "decode")
    assert cfg.overrides == ModelOverrides("/t", "/c.jinja", 64)
    assert (cfg.mem_fraction_static, cfg.kv_cache_mb) == (0.5, WorkerConfig("d", "m").kv_cache_mb)
    assert worker_config(parse("decode", "--model", "tiny"), "decode").overrides == \
        ModelOverrides()


def test_launch_hands_them_to_workers_and_front() -> None:
    la = parse("launch", "--model-path", "tiny", "--tokenizer-path", "/t", "--chat-template",
               "{{ x }}", "--context-length", "64", "--mem-fraction-static", "0.25",
               "--served-model-name", "m1", "--tool-call-parser", "llama3")
    cfg = worker_config(parse("prefill", *worker_argv(la)), "prefill")
    assert (cfg.overrides, cfg.mem_fraction_static) == (ModelOverrides("/t", "{{ x }}", 64), 0.25)
    front = http_config(parse("http", "--model", "tiny", *passthrough_argv(la, HTTP_PASSTHROUGH)))
    assert (front.served_model_name, front.overrides, front.tool_call_parser) == \
        ("m1", ModelOverrides("/t", "{{ x }}", None), "llama3")
    assert http_config(parse("http", "--model", "tiny")) == HttpConfig(model="tiny")


def test_kv_cache_mb_and_mem_fraction_exclude_each_other(capsys) -> None:
    with pytest.raises(SystemExit):
        parse("prefill", "--model", "tiny", "--kv-cache-mb", "8", "--mem-fraction-static", "0.5")
    assert "not allowed with argument" in capsys.readouterr().err
    for bad in ("0", "1", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="--mem-fraction-static must be in"):
            worker_config(parse("prefill", "--model", "tiny", "--mem-fraction-static", bad),
                          "prefill")


def test_help_explains_each_flag(capsys) -> None:
    for command, flags in (("launch", ("--model-path", "--tokenizer-path", "--chat-template",
                                       "--context-length", "--mem-fraction-static",
                                       "--served-model-name", "--http-port")),
                           ("http", ("--model-path", "--served-model-name", "--tokenizer-path",
                                     "--chat-template", "SGLang's --port"))):
        with pytest.raises(SystemExit):
            parse(command, "--help")
        out = capsys.readouterr().out
        assert all(f in out for f in flags), (command, out)


def test_mem_fraction_is_fraction_of_total_minus_weights(monkeypatch) -> None:
    net = torch.nn.Linear(256, 1024)                 # 257 x 1024 float32 = 1,052,672 bytes
    monkeypatch.setattr(mem_fraction, "device_memory", lambda device: 64 * 2 ** 20)
    mb = mem_fraction.kv_cache_mb(0.5, 256, net, torch.device("cpu"))
    assert mb == pytest.approx(32 - 257 * 1024 * 4 / 2 ** 20)
    assert mem_fraction.kv_cache_mb(None, 256, net, torch.device("cpu")) == 256
    with pytest.raises(ModelError, match="leaves no room for KV"):
        mem_fraction.kv_cache_mb(0.01, 256, net, torch.device("cpu"))


def test_cpu_memory_is_ram_within_the_cgroup(monkeypatch, tmp_path: Path) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    monkeypatch.setattr(mem_fraction, "CGROUP_MEMORY_MAX", limit)
    ram = mem_fraction.device_memory(torch.device("cpu"))
    assert ram > 2 ** 28
    limit.write_text(f"{2 ** 28}\n")
    assert mem_fraction.device_memory(torch.device("cpu")) == 2 ** 28


def test_context_length_lowers_the_model_context() -> None:
    model = load_model("tiny", overrides=ModelOverrides(context_length=100))
    assert model.cfg.max_position == 100
    with pytest.raises(ModelError, match="--context-length 5000: must be in 1..4096"):
        load_model("tiny", overrides=ModelOverrides(context_length=5000))


def test_chat_template_as_text_or_file(tmp_path: Path, gguf: str) -> None:
    _, chat, problem = load_text(gguf, ModelOverrides(chat_template=TEMPLATE))
    assert chat.render(HI) == "[user]hi>" and problem == ""
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    model = load_model("tiny", overrides=ModelOverrides(tokenizer_path=gguf, chat_template=str(f)))
    assert model.encode_chat(HI) == list(b"[user]hi>")


def test_chat_template_text_of_any_length(gguf: str) -> None:
    # 5 kB of template text, one line and several: never taken for a file name (issue 46)
    pad = "{# " + "x" * 5000 + " #}"
    for text in (pad + TEMPLATE, pad + "\n" + TEMPLATE + "\n"):
        _, chat, _ = load_text(gguf, ModelOverrides(chat_template=text))
        assert len(text) > 5000 and chat.render(HI).strip() == "[user]hi>"
    with pytest.raises(ModelError, match="not a file: File name too long"):
        load_text(gguf, ModelOverrides(chat_template="n" * 300))


def test_chat_template_refusals(tmp_path: Path, gguf: str) -> None:
    with pytest.raises(ModelError, match="SGLang's built-in template names"):
        load_text(gguf, ModelOverrides(chat_template="chatml"))
    j = tmp_path / "t.json"
    j.write_text("{}")
    with pytest.raises(ModelError, match="JSON conversation templates"):
        load_text(gguf, ModelOverrides(chat_template=str(j)))
    with pytest.raises(ModelError, match="syntax error"):
        load_text(gguf, ModelOverrides(chat_template="{% for %}"))


def test_tokenizer_path_brings_its_template(tmp_path: Path, gguf: str) -> None:
    tok, chat, _ = load_text("tiny")
    assert chat is None                              # tiny has none of its own
    tok, chat, problem = load_text("tiny", ModelOverrides(tokenizer_path=gguf))
    assert chat.source == CHATML and problem == ""
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(tiny_tokenizer().to_json())
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    tok, chat, _ = load_text("tiny", ModelOverrides(tokenizer_path=str(d)))
    assert chat.source == TEMPLATE and tok.encode("ab", add_special_tokens=False) == [97, 98]
    tok, chat, problem = load_text(gguf, ModelOverrides(tokenizer_path=str(d / "tokenizer.json")))
    assert chat is None and "has no chat template" in problem


def test_tokenizer_path_refusals(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="--tokenizer-path .*hub names are not fetched"):
        load_text("tiny", ModelOverrides(tokenizer_path="Qwen/Qwen2-0.5B"))
    big = tmp_path / "big.json"
    vocab = {f"t{i}": i for i in range(TINY_CONFIG["vocab_size"] + 1)}
    big.write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab,
                                                           "unk_token": "t0"}}))
    with pytest.raises(ModelError, match="more than the model's vocabulary"):
        load_model("tiny", overrides=ModelOverrides(tokenizer_path=str(big)))


def test_a_chat_template_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_CONFIG | {"architectures":
                                                             ["LlamaForCausalLM"]}))
    with pytest.raises(ModelError, match="--chat-template: .*no tokenizer.json"):
        load_text(str(d), ModelOverrides(chat_template=TEMPLATE))


def test_chat_template_keeps_the_model_bos_and_eos(gguf: str) -> None:
    _, own, _ = load_text(gguf)
    _, chat, _ = load_text(gguf, ModelOverrides(chat_template="{{ bos_token }}|{{ eos_token }}"))
    assert isinstance(chat, ChatTemplate)
    assert (chat.bos_token, chat.eos_token) == (own.bos_token, own.eos_token)


@pytest.mark.parametrize("flags, message", [
    (("--chat-template", "chatml"), "SGLang's built-in template names"),
    (("--context-length", "0"), "--context-length 0: must be in 1..4096"),
    (("--tokenizer-path", "org/name"), "hub names are not fetched"),
    (("--mem-fraction-static", "1"), "--mem-fraction-static must be in"),
])
def test_launch_refuses_before_starting_anything(monkeypatch, capsys, flags, message) -> None:
    import zpd.ops.launch
    monkeypatch.setattr(zpd.ops.launch, "launch", lambda *a: pytest.fail("launch started"))
    assert main(["launch", "--model", "tiny", *flags]) == 2
    assert message in capsys.readouterr().err
