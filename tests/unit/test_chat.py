"""Chat templates (engines/formats/chat.py): SmolLM2's GGUF template against transformers'
apply_chat_template, Hugging Face directories, and hostile messages and templates."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from engines.formats.chat import MAX_MESSAGES, ChatTemplate, encode_chat
from engines.config import ModelError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_IDS = [int(i) for i in (
    "1 9690 198 2683 359 253 5356 5646 11173 3365 3511 308 34519 28 7018 411 407 19712 8182 "
    "2 198 1 4093 198 1780 314 260 3575 282 4649 47 2 198 1 520 9531 198").split()]
CONVERSATIONS = [
    FRANCE,
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! 你好 🙂"},
     {"role": "user", "content": "café?\n  and  spaces"}],
]





@pytest.fixture(scope="module")
def template(smollm_meta, smollm) -> ChatTemplate:
    return ChatTemplate.from_gguf(smollm_meta, smollm)



# --- SmolLM2 against transformers ----------------------------------------------------------

def test_smollm_prompt_ids_are_exact(smollm, template):
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert encode_chat(smollm, template, FRANCE) == FRANCE_IDS


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm_renders_as_transformers(smollm, template, smollm_ref, messages, generation_prompt):
    ref = smollm_ref.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                         tokenize=True)
    text = template.render(messages, add_generation_prompt=generation_prompt)
    assert text == smollm_ref.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False)
    assert smollm.encode(text, add_special_tokens=False) == list(ref["input_ids"])
    if generation_prompt:
        assert encode_chat(smollm, template, messages) == list(ref["input_ids"])


def test_gguf_without_template_has_none(smollm_meta, smollm):
    meta = {k: v for k, v in smollm_meta.items() if k != "tokenizer.chat_template"}
    assert ChatTemplate.from_gguf(meta, smollm) is None
    with pytest.raises(ModelError, match="chat_template is not a string"):
        ChatTemplate.from_gguf(meta | {"tokenizer.chat_template": [1]}, smollm)


# --- rendering ----------------------------------------------------------------------------

def test_variables_filters_and_globals():
    t = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m.content | tojson }};"
        "{{ m.name | default('-') }}\n{% endfor %}{{ eos_token }}{{ strftime_now('%Y') }}"
        "{% if add_generation_prompt %}>{% endif %}", "<s>", "</s>")
    text = t.render([{"role": "user", "content": 'café <b> "x"', "name": "ann"}], False)
    assert text == f'<s>user="café <b> \\"x\\"";ann\n</s>{datetime.date.today().year}'
    assert ChatTemplate("{{ messages | tojson(indent=1) }}", None, None).render(
        [{"role": "a", "content": "é"}]) == json.dumps([{"role": "a", "content": "é"}],
                                                        ensure_ascii=False, indent=1)


def test_missing_special_tokens_are_undefined():
    t = ChatTemplate("{{ 'yes' if bos_token is defined else 'no' }}", None, "</s>")
    assert t.render([{"role": "user", "content": "x"}]) == "no"


def test_loop_controls_are_available():
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                     "{{ m.content }}{% endfor %}", None, None)
    assert t.render([{"role": "u", "content": "a"}, {"role": "u", "content": "b"}]) == "a"


# --- hostile messages and templates -------------------------------------------------------

@pytest.mark.parametrize("messages,message", [
    (None, "non-empty list"),
    ({"role": "user", "content": "x"}, "non-empty list"),
    ([], "non-empty list"),
    ([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1), "too many messages"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\].role must be a string"),
    ([{"role": "user", "content": "x"}, {"role": 3, "content": "x"}], r"messages\[1\].role"),
    ([{"role": "user"}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": None}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "content must be a string"),
])
def test_malformed_messages_are_value_errors(template, messages, message):
    with pytest.raises(ValueError, match=message):
        template.render(messages)


def test_syntax_error_is_a_model_error():
    with pytest.raises(ModelError, match="syntax error"):
        ChatTemplate("{% for m in messages %}{{ m.content }", None, None)


def test_raise_exception_is_a_value_error_with_its_message():
    t = ChatTemplate("{% if messages[0].role != 'user' %}"
                     "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
                     "{% endif %}ok", None, None)
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="^Conversation roles must alternate user/assistant$"):
        t.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages[0].__class__.__init__.__globals__ }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{{ raise_exception.__globals__ }}",
])
def test_sandbox_refuses_attribute_escapes_and_mutation(source):
    with pytest.raises(ValueError, match="sandbox|unsafe|not safely"):
        ChatTemplate(source, None, None).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", ["{{ messages[5].content }}", "{{ 1 + messages }}",
                                    "{{ 1 / 0 }}", "{{ messages[0]['content'] | int + 'a' }}"])
def test_template_failures_are_value_errors(source):
    with pytest.raises(ValueError, match="chat template failed"):
        ChatTemplate(source, None, None).render([{"role": "user", "content": "x"}])


# --- Hugging Face directories -------------------------------------------------------------

def write_config(root: Path, **config) -> Path:
    root.mkdir(exist_ok=True)
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def test_dir_template_from_tokenizer_config(tmp_path):
    root = write_config(tmp_path / "m", chat_template="{{ bos_token }}{{ messages[0].content }}",
                        bos_token={"content": "<s>", "lstrip": False}, eos_token="</s>")
    t = ChatTemplate.from_dir(root)
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>hi"


def test_dir_named_templates_use_default(tmp_path):
    root = write_config(tmp_path / "m", chat_template=[
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}])
    assert ChatTemplate.from_dir(root).render([{"role": "user", "content": "x"}]) == "plain"


def test_dir_jinja_file_wins(tmp_path):
    root = write_config(tmp_path / "m", chat_template="from config", eos_token="</s>")
    (root / "chat_template.jinja").write_text("from file {{ eos_token }}")
    assert ChatTemplate.from_dir(root).render([{"role": "user", "content": "x"}]) == (
        "from file </s>")


def test_dir_without_template(tmp_path):
    assert ChatTemplate.from_dir(write_config(tmp_path / "m", eos_token="</s>")) is None
    assert ChatTemplate.from_dir(tmp_path) is None
    root = write_config(tmp_path / "n", chat_template=[{"name": "tool_use", "template": "t"}])
    assert ChatTemplate.from_dir(root) is None


@pytest.mark.parametrize("content,message", [
    ("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object"),
    ('{"chat_template": 7}', "neither a string"),
    ('{"chat_template": "{% if %}"}', "syntax error"),
])
def test_dir_broken_config_is_a_model_error(tmp_path, content, message):
    (tmp_path / "tokenizer_config.json").write_text(content)
    with pytest.raises(ModelError, match=message):
        ChatTemplate.from_dir(tmp_path)
