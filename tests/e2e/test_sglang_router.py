"""SGLang's own clients in front of zpd: `sglang-router` (the Rust router slime launches
in front of its engines) with `zpd launch --http-port` as its one worker, spoken to as
SGLang's users do (raw /generate, the real `openai` client), and sglang.lang programs
(SGLang's frontend language) against the front. Every answer through the router must
equal the front's own answer to the same request (greedy, float64).

The router and sglang live in their own virtual environments (scripts/install.sh
--test puts them in .venv-sglang-router and .venv-sglang; ZPD_SGLANG_ROUTER_VENV and
ZPD_SGLANG_VENV move them). Without one its tests are skipped, except under CI=true,
where a missing one is a failure: CI must run them.

One cluster and one router for the module, on the tiny model written as a GGUF file
(a byte-level tokenizer and a chatml template: text and chat run, at tiny's cost)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from tests.e2e.cluster import ROOT, Cluster
from tests.unit.gguf_files import write_tiny_gguf

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")
aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

VENV_ENV = "ZPD_SGLANG_ROUTER_VENV"           # scripts/install.sh reads the same variable
SERVED = "tiny-chat"                          # --served-model-name: the id clients send
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
# What must agree between two answers to one greedy request (ids and timings differ; a
# repeated prompt may be served from the prefix cache).
SAME_META = ("finish_reason", "prompt_tokens", "completion_tokens", "weight_version")


def pinned_version() -> str:
    """The version scripts/install.sh installs: the one this test must run against."""
    found = re.search(r"^SGLANG_ROUTER=(\S+)$", (ROOT / "scripts/install.sh").read_text(), re.M)
    assert found, "scripts/install.sh no longer pins SGLANG_ROUTER"
    return found.group(1)


def router_python() -> Path:
    return venv_python(VENV_ENV, ".venv-sglang-router", "sglang-router")


def venv_python(env: str, default: str, what: str) -> Path:
    venv = Path(os.environ.get(env) or ROOT / default)
    py = venv / "bin" / "python"
    if not py.exists():
        why = f"{what} is not installed in {venv} (bash scripts/install.sh --test)"
        if os.environ.get("CI"):
            pytest.fail(why + "; under CI it must be")
        pytest.skip(why)
    return py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SglangRouter:
    """`python -m sglang_router.launch_router` in its own process group."""

    def __init__(self, python: Path, worker: str, log: Path) -> None:
        self.port, self.log = free_port(), log
        argv = [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(self.port), "--worker-urls", f"http://{worker}",
                "--policy", "round_robin", "--log-level", "info"]
        self.proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> dict:
        """The router's /workers once it lists our front as healthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                status, body = call(self.url, "GET", "/workers", timeout=5)
                if status == 200 and any(w.get("is_healthy") for w in body["workers"]):
                    return body
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"sglang-router not ready:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def call(base: str, method: str, path: str, body=None, timeout: float = 60) -> tuple[int, object]:
    """One request: (status, the JSON answer or the list of SSE events)."""
    async def go():
        data = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async with s.request(method, base + path, data=data, headers=headers) as r:
                text = await r.text()
                if r.content_type == "text/event-stream":
                    return r.status, [e[6:] if e[6:] == "[DONE]" else orjson.loads(e[6:])
                                      for e in text.split("\n\n") if e.startswith("data: ")]
                try:
                    return r.status, orjson.loads(text) if text else None
                except orjson.JSONDecodeError:
                    return r.status, text
    return asyncio.run(go())


@pytest.fixture(scope="module")
def router_py() -> Path:
    return router_python()          # before the cluster: a missing router costs no start-up


@pytest.fixture(scope="module")
def cluster(router_py, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang-router")
    gguf = write_tiny_gguf(tmp / "tiny.gguf")
    with Cluster(tmp, model=str(gguf),
                 extra=("--http-port", "0", "--served-model-name", SERVED)) as c:
        c.front = f"http://{c.info['http']}"
        yield c


@pytest.fixture(scope="module")
def router(router_py, cluster, tmp_path_factory):
    r = SglangRouter(router_py, cluster.info["http"],
                     tmp_path_factory.mktemp("router") / "router.log")
    try:
        r.workers = r.wait_ready()
        yield r
    finally:
        r.stop()


def both(cluster, router, path: str, body: dict) -> tuple[object, object]:
    """The same request to the router and to the front; both must answer 200."""
    via = call(router.url, "POST", path, body)
    direct = call(cluster.front, "POST", path, body)
    for name, (status, answer) in (("router", via), ("front", direct)):
        assert status == 200, (name, status, answer, router.log.read_text()[-2000:])
    return via[1], direct[1]


def same_answer(a: dict, b: dict) -> None:
    assert (a["text"], a["output_ids"]) == (b["text"], b["output_ids"])
    assert {k: a["meta_info"].get(k) for k in SAME_META} == \
        {k: b["meta_info"].get(k) for k in SAME_META}


def test_the_pinned_router_runs_in_front(router_py, router, cluster):
    measured = subprocess.run([str(router_py), "-c", "import importlib.metadata as m; "
                               "print(m.version('sglang-router'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
    assert measured == pinned_version()
    assert [w["url"] for w in router.workers["workers"]] == [cluster.front]


def test_generate_text_and_ids_equal_the_front(cluster, router):
    for prompt in ({"text": "Hello"}, {"input_ids": [5, 6, 7, 104, 101]}):
        via, direct = both(cluster, router, "/generate", prompt | {"sampling_params": GREEDY})
        same_answer(via, direct)
        assert via["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


def test_a_batch_answers_a_list_in_order(cluster, router):
    prompts = {"input_ids": [[5, 6, 7], list(range(40, 60))], "sampling_params": GREEDY}
    via, direct = both(cluster, router, "/generate", prompts)
    assert len(via) == len(direct) == 2
    for a, b in zip(via, direct):
        same_answer(a, b)
    assert via[0]["output_ids"] != via[1]["output_ids"]


def test_a_text_batch_is_the_routers_own_422(cluster, router):
    """sglang-router 0.3.2 types /generate's `text` as one string: a list of texts is its
    own 422 (measured), before any worker sees it; the front itself takes the batch."""
    body = {"text": ["Hello", "The sky is"], "sampling_params": GREEDY}
    status, answer = call(router.url, "POST", "/generate", body)
    assert status == 422 and "text" in answer, answer
    status, answer = call(cluster.front, "POST", "/generate", body)
    assert status == 200 and len(answer) == 2, answer


def test_a_stream_through_the_router_ends_as_the_whole_answer(cluster, router):
    body = {"text": "Hello", "sampling_params": GREEDY}
    status, events = call(router.url, "POST", "/generate", body | {"stream": True})
    assert status == 200 and events[-1] == "[DONE]", events
    chunks = events[:-1]
    assert len(chunks) >= 2, "one chunk is not a stream"
    _, whole = call(cluster.front, "POST", "/generate", body)
    same_answer(chunks[-1], whole)
    # each chunk carries the output so far (SGLang's shape), growing to the whole
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == GREEDY["max_new_tokens"]


@pytest.fixture(scope="module")
def clients(cluster, router):
    def make(base: str):
        return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    return make(router.url), make(cluster.front)


def test_openai_models_name_the_served_model(cluster, router, clients):
    via, direct = clients
    assert [m.id for m in direct.models.list().data] == [SERVED]
    assert SERVED in [m.id for m in via.models.list().data]


def test_openai_completions_through_the_router(clients):
    via, direct = clients
    kw = dict(model=SERVED, prompt=["Hello", "The sky is"], max_tokens=8, temperature=0)
    a, b = via.completions.create(**kw), direct.completions.create(**kw)
    assert [(c.index, c.text, c.finish_reason) for c in a.choices] == \
        [(c.index, c.text, c.finish_reason) for c in b.choices]
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.usage.completion_tokens == b.usage.completion_tokens > 0
    streamed: dict[int, str] = {}
    for ev in via.completions.create(stream=True, **kw):
        for c in ev.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in b.choices}


def test_openai_chat_through_the_router(clients):
    via, direct = clients
    kw = dict(model=SERVED, max_tokens=12, temperature=0,
              messages=[{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "hi"}])
    a, b = via.chat.completions.create(**kw), direct.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].finish_reason == b.choices[0].finish_reason
    assert a.usage.prompt_tokens == b.usage.prompt_tokens > 0
    streamed = "".join(ev.choices[0].delta.content or "" for ev in
                       via.chat.completions.create(stream=True, **kw) if ev.choices)
    assert streamed == b.choices[0].message.content


def cached_pages(cluster) -> int:
    with cluster.client(timeout=30) as client:
        status = client.admin("status")
    assert status["ok"], status
    return sum(w["kv_pages"].get("cached", 0) for w in status["workers"])


def test_flush_cache_fans_out_through_the_router(cluster, router):
    # a prompt of several pages leaves them in the prefill's prefix cache
    long = {"input_ids": list(range(3, 70)), "sampling_params": GREEDY}
    assert call(cluster.front, "POST", "/generate", long)[0] == 200
    assert cached_pages(cluster) > 0
    status, answer = call(router.url, "POST", "/flush_cache")
    assert status == 200 and answer.get("workers_flushed") == 1, answer
    assert cached_pages(cluster) == 0


def test_get_flush_cache_on_the_front(cluster, router):
    """slime and verl call GET /flush_cache on each engine's URL; sglang-router 0.3.2
    serves only POST itself (its own 405, measured), so GET is the front's to answer."""
    assert call(router.url, "GET", "/flush_cache")[0] == 405
    long = {"input_ids": list(range(3, 70)), "sampling_params": GREEDY}
    assert call(cluster.front, "POST", "/generate", long)[0] == 200
    assert cached_pages(cluster) > 0
    assert call(cluster.front, "GET", "/flush_cache")[0] == 200
    assert cached_pages(cluster) == 0


def test_sglang_lang_programs_run_against_the_front(cluster):
    """gen, run_batch, a stream, fork, typed and regex gens, and select with both of its
    choice methods, as sglang.lang 0.5.23 sends them (its select reads
    input_token_logprobs of a request without logprob_start_len, and of one that starts
    at prompt length - 2)."""
    python = venv_python("ZPD_SGLANG_VENV", ".venv-sglang", "sglang (the frontend language)")
    script = ROOT / "tests/e2e/sglang_lang_calls.py"
    run = subprocess.run([str(python), str(script), cluster.front], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    got = orjson.loads(run.stdout.strip().splitlines()[-1])
    assert got["version"] == "0.5.23"

    def greedy(text: str, n: int) -> str:
        status, answer = call(cluster.front, "POST", "/generate", {
            "text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
        assert status == 200, answer
        return answer["text"]
    assert got["gen"] == got["stream"] == greedy("Hello", 8)
    assert got["batch"] == [greedy("Hello", 8), greedy("The sky is", 8)]
    assert got["fork"] == "Hello" + "|".join(greedy(f"Hello number {i}:", 4) for i in range(2))
    assert re.fullmatch(r"[-+]?[0-9]+", got["typed"]["n"]), got        # sgl.gen(dtype=int)
    assert got["typed"]["yes"] in ("yes", "no"), got
    for method in ("unconditional", "token_length"):
        assert got[method]["choice"] in ("blue", "green", "red"), got
        assert got[method]["scores"] == 3 and got[method]["scores_finite"], got
