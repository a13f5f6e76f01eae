"""Mixtures of experts (Qwen3-MoE, Mixtral, GLM-4.5) through `zpd run` and a real
1P1D cluster: greedy float64 tokens equal transformers', every page comes back, and a
pause(retract) → update weights → continue cycle is exact under W1 then W2."""
from __future__ import annotations

import subprocess
import time

import orjson
import pytest
import torch

from engines.loader import default_version, load_model
from tests.e2e.cluster import ROOT, Cluster, assert_all_pages_free, zpd_cmd
from tests.e2e.test_retract import Collector, check_exact
from tests.unit.hf_models import MOE_VARIANTS, hf_model, make_checkpoint

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")
pytest.importorskip("transformers", reason="transformers is the test-time reference; pip install '.[test]'")

PROMPTS = [[5], [17, 3, 250, 9, 41], list(range(40, 80))]     # one token to three pages
NEW = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {kind: make_checkpoint(kind, root) for kind in sorted(MOE_VARIANTS)}


def _reference(path, prompts=PROMPTS, new=NEW) -> list[list[int]]:
    ref = hf_model(path, torch.float64)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def references(checkpoints):
    return {kind: _reference(path) for kind, path in checkpoints.items()}


@pytest.mark.parametrize("kind", sorted(MOE_VARIANTS))
def test_zpd_run_equals_transformers(kind, checkpoints, references):
    argv = zpd_cmd("run", "--model", str(checkpoints[kind]), "--dtype", "float64", "--json",
                   "--temperature", "0", "--ignore-eos", "--max-new-tokens", str(NEW), "--threads", "1")
    for p in PROMPTS:
        argv += ["--input-ids", ",".join(map(str, p))]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    outs = [orjson.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert [o["output_ids"] for o in outs] == references[kind]


@pytest.fixture(scope="module", params=sorted(MOE_VARIANTS))
def cluster(request, checkpoints, tmp_path_factory):
    kind = request.param
    with Cluster(tmp_path_factory.mktemp(kind), model=str(checkpoints[kind])) as c:
        yield kind, c


def test_1p1d_equals_transformers_and_every_page_comes_back(cluster, references):
    kind, c = cluster
    with c.client() as client:
        for p, want in zip(PROMPTS, references[kind]):
            out = client.generate(input_ids=p, sampling_params={
                "temperature": 0, "max_new_tokens": NEW, "ignore_eos": True})
            assert out["output_ids"] == want, (kind, p)
        assert_all_pages_free(client)


@pytest.mark.parametrize("cluster", ["qwen3_moe"], indirect=True)   # the routers differ only in the model
def test_retract_update_continue_is_exact_under_w1_then_w2(cluster, checkpoints, tmp_path_factory):
    """Requests paused mid-output resume under the second checkpoint's experts: the
    tokens before the pause are W1's greedy continuation, those after W2's."""
    kind, c = cluster
    w1, w2 = checkpoints[kind], make_checkpoint(kind, tmp_path_factory.mktemp("w2"), seed=1)
    models = {default_version(str(w1)): load_model(str(w1), dtype="float64"),
              "w2": load_model(str(w2), dtype="float64")}
    work = [([7 + i, 100, 3 * i + 1, 250], 200) for i in range(6)]
    with c.client() as client, Collector(client) as col:
        for i, (ids, n) in enumerate(work):
            col.submit(ids, n, f"m{i}")
        col.start()
        deadline = time.monotonic() + 60
        while min(col.tokens_so_far().values()) < 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        with c.client() as admin:
            assert admin.admin("pause", mode="retract", timeout=30)["ok"]
            assert admin.admin("update_weights", path=str(w2), version="w2")["ok"]
            assert admin.admin("continue")["ok"]
        outs = col.wait()
        switched = 0
        for i, (ids, _) in enumerate(work):
            check_exact(ids, outs[f"m{i}"], models)
            switched += len(set(outs[f"m{i}"]["weight_versions"])) == 2
        assert switched, "no request was paused in the middle of its output"
        assert_all_pages_free(client)
    with c.client() as admin:
        assert admin.admin("update_weights", path=str(w1), version=default_version(str(w1)))["ok"]
