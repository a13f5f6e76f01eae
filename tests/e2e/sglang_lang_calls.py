"""Run by tests/e2e/test_sglang_router.py in the SGLang frontend's own environment
(.venv-sglang): sglang.lang 0.5.23's programs against a zpd front, as its users write
them. Prints one JSON object of what each program got; the test judges it."""
from __future__ import annotations

import json
import math
import sys

import sglang as sgl
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.choices import token_length_normalized, unconditional_likelihood_normalized

CHOICES = ["blue", "green", "red"]


@sgl.function
def complete(s, prompt):
    s += prompt
    s += sgl.gen("out", max_tokens=8, temperature=0)


@sgl.function
def pick(s, method):
    s += "The sky is "
    s += sgl.select("color", choices=CHOICES, choices_method=method)


@sgl.function
def forked(s):
    s += "Hello"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += " number %d:" % i
        f += sgl.gen("x", max_tokens=4, temperature=0)
    s += "|".join(f["x"] for f in forks)


@sgl.function
def typed(s):
    s += "Count: "
    s += sgl.gen("n", dtype=int, max_tokens=8, temperature=0)
    s += " Sure? "
    s += sgl.gen("yes", regex=r"(yes|no)", max_tokens=4, temperature=0)


def finite(xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def main(url: str) -> None:
    sgl.set_default_backend(RuntimeEndpoint(url))
    got: dict = {"version": sgl.__version__}
    got["gen"] = complete.run(prompt="Hello")["out"]
    got["batch"] = [s["out"] for s in complete.run_batch([{"prompt": "Hello"},
                                                          {"prompt": "The sky is"}])]
    got["stream"] = "".join(complete.run(prompt="Hello", stream=True).text_iter("out"))
    for name, method in (("unconditional", unconditional_likelihood_normalized),
                         ("token_length", token_length_normalized)):
        state = pick.run(method=method)
        meta = state.get_meta_info("color")
        got[name] = {"choice": state["color"],
                     "scores_finite": finite(meta["normalized_prompt_logprobs"]),
                     "scores": len(meta["normalized_prompt_logprobs"])}
    got["fork"] = forked.run().text()
    state = typed.run()
    got["typed"] = {"n": state["n"], "yes": state["yes"]}
    print(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1])
