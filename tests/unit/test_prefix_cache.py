"""The prefill's prefix cache: the cache itself (engines/kv/prefix_cache.py), then the
whole handoff in one process (tests/unit/inproc.py, float64) with the cache on,
against the same cluster with it off and against `zpd run`."""
from __future__ import annotations

import random

import pytest

from engines.kv.allocator import PageAllocator
from engines.kv.prefix_cache import PrefixCache
from tests.unit.inproc import InprocCluster, reference
from tests.unit.test_handoff import reference_tiny

PAGE = 16


def cache_of(total: int = 16) -> PrefixCache:
    return PrefixCache(PageAllocator(total), PAGE)


def computed(c: PrefixCache, tokens: list[int], version: str = "v1") -> list[int]:
    """What the prefill does for one prompt: match, allocate the rest, compute, insert."""
    keys = c.keys(tokens, version)
    pages = c.match(keys, len(tokens))
    skip = len(pages)
    need = -(-len(tokens) // PAGE) - skip
    assert c.make_room(need)
    pages += c.allocator.alloc(need)
    c.insert(keys, pages, skip)
    return pages


def accounted(c: PrefixCache, held: set[int]) -> None:
    assert c.allocator.free + len(held) + c.cached == c.allocator.total
    c.allocator.check()


# --- the cache ---------------------------------------------------------------------------


def test_a_shared_prefix_is_matched_by_content_and_version():
    c = cache_of()
    a = computed(c, list(range(40)))                      # 2 full pages + 8 tokens
    assert c.release(a) == [a[2]]                         # the partial page is the caller's
    c.allocator.free_pages([a[2]])
    assert c.cached == 2
    keys = c.keys(list(range(32)) + [99] * 5, "v1")
    assert c.match(keys, 37) == a[:2]                     # same first 32 tokens
    c.release(a[:2])
    assert c.peek(c.keys(list(range(40)), "v2"), 40) == 0          # other weights
    assert c.peek(c.keys([1] + list(range(1, 40)), "v1"), 40) == 0  # other first page
    assert c.peek(c.keys(list(range(32)), "v1"), 32) == 1          # one token always computed
    accounted(c, set())


def test_pages_in_use_are_never_evicted_and_idle_ones_go_least_recent_first():
    c = cache_of(8)
    first = computed(c, list(range(48)) + [1])            # 3 full pages + 1
    c.allocator.free_pages(c.release(first))              # 3 idle
    second = computed(c, list(range(100, 148)) + [1])     # 3 more; 2 pages were left free
    c.allocator.free_pages(c.release(second))
    user = c.match(c.keys(list(range(48)) + [1], "v1"), 49)   # `first` in use again
    assert user == first[:3] and c.cached == 3
    assert c.make_room(5)                                 # only `second`'s pages can go
    assert c.peek(c.keys(list(range(48)) + [1], "v1"), 49) == 3
    assert c.peek(c.keys(list(range(100, 148)) + [1], "v1"), 49) == 0
    assert not c.make_room(6)                             # the rest is in use
    accounted(c, set(user))
    c.release(user)
    accounted(c, set())


def test_a_prompts_later_pages_are_evicted_before_its_earlier_ones():
    c = cache_of(8)
    tokens = list(range(64)) + [7]                        # 4 full pages + 1
    pages = computed(c, tokens)
    c.allocator.free_pages(c.release(pages))              # 4 cached, 4 free
    assert c.make_room(6)                                 # 2 must go: the last two
    assert c.peek(c.keys(tokens, "v1"), len(tokens)) == 2
    assert set(c.idle) == set(pages[:2])
    accounted(c, set())


def test_invalidate_frees_idle_pages_now_and_used_ones_at_release():
    c = cache_of()
    a = computed(c, list(range(40)))
    c.allocator.free_pages(c.release(a))
    b = computed(c, list(range(200, 240)))                 # in use during the invalidation
    assert c.invalidate() == 2 and c.cached == 0
    assert c.peek(c.keys(list(range(40)), "v1"), 40) == 0
    c.allocator.free_pages(c.release(b))                   # its pages go back, not to the cache
    assert c.cached == 0 and c.allocator.free == c.allocator.total


def test_random_workloads_keep_the_accounting(seed=3):
    rng = random.Random(seed)
    c = cache_of(24)
    prompts = [[rng.randrange(5) for _ in range(rng.randint(1, 60))] for _ in range(12)]
    live: list[list[int]] = []
    for _ in range(300):
        if live and (rng.random() < 0.5 or c.allocator.free + c.evictable < 5):
            c.allocator.free_pages(c.release(live.pop(rng.randrange(len(live)))))
        else:
            tokens = rng.choice(prompts)
            keys = c.keys(tokens, "v1")
            hit = c.peek(keys, len(tokens))
            if -(-len(tokens) // PAGE) - hit > c.allocator.free + max(0, c.evictable - hit):
                continue
            live.append(computed(c, tokens))
        accounted(c, {p for pages in live for p in pages})
        if rng.random() < 0.02:
            c.invalidate()


# --- the cluster -------------------------------------------------------------------------


@pytest.fixture
def cluster():
    c = InprocCluster(kv_cache_mb=2.0)
    yield c
    c.close()


def computed_tokens(c: InprocCluster) -> int:
    return c.prefill.status_fields().to_wire()["counters"]["prompt_tokens_computed"]


SYSTEM = [(7 * i + 3) % 250 for i in range(48)]          # 3 pages


@pytest.mark.parametrize("shared", [48, 40, 32, 17])        # page boundaries and mid-page
def test_greedy_with_the_cache_equals_without_it(cluster, shared):
    off = InprocCluster(kv_cache_mb=2.0, prefix_cache=False)
    try:
        prompts = [SYSTEM[:shared] + [11 + i, 200 - i, 5] for i in range(4)] + [SYSTEM[:shared]]
        for prompt in prompts:
            got = cluster.run(cluster.submit(prompt, 10)).token_ids
            assert got == off.run(off.submit(prompt, 10)).token_ids == \
                reference(cluster, prompt, 10)
        cluster.check_pages()
        off.check_pages()
        # after the first, each takes the shared full pages from the cache, all but
        # the page holding its last token
        hits = sum(min(shared // PAGE, (len(p) - 1) // PAGE) * PAGE for p in prompts[1:])
        assert computed_tokens(cluster) == sum(len(p) for p in prompts) - hits
        assert computed_tokens(off) == sum(len(p) for p in prompts)
    finally:
        off.close()


def test_samples_arriving_together_compute_their_prompt_once(cluster):
    """GRPO: eight samples of one prompt at once. One computes it; the seven others
    wait a step and take it from the cache (each still computes its last page)."""
    prompt = SYSTEM + [9, 8, 7, 6]                           # 52 tokens: 3 full pages + 4
    rids = [cluster.submit(prompt, 6) for _ in range(8)]
    want = reference(cluster, prompt, 6)
    for rid in rids:
        assert cluster.run(rid).token_ids == want
    assert computed_tokens(cluster) == 52 + 7 * 4
    cluster.check_pages()
    assert cluster.prefill.status_fields().to_wire()["prefix_cache"]["hit_rate"] == round(7 * 48 / (8 * 52), 4)


def test_new_weights_never_meet_old_kv(cluster):
    """Even under the same version name: an update invalidates the cache."""
    prompt = SYSTEM + [1, 2]
    assert cluster.run(cluster.submit(prompt, 6)).token_ids == reference_tiny("tiny", prompt, 6)
    assert cluster.prefill.status_fields().to_wire()["kv_pages"]["cached"] == 3
    for spec in ("tiny:7", "tiny:3"):
        assert cluster.admin("update_weights", path=spec, version="same")["ok"]
        assert cluster.prefill.status_fields().to_wire()["kv_pages"]["cached"] == 0
        assert cluster.run(cluster.submit(prompt, 6)).token_ids == reference_tiny(spec, prompt, 6)
    cluster.check_pages()


def test_eviction_under_pressure_keeps_outputs_exact(cluster):
    """More distinct prompts than the pool holds: idle cached pages are evicted,
    pages of running requests never are."""
    total = cluster.prefill.status_fields().to_wire()["kv_pages"]["total"]
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(60)] for _ in range(total // 2)]
    rids = [(p, cluster.submit(p, 4)) for p in prompts + prompts[:4]]
    for prompt, rid in rids:
        assert cluster.run(rid).token_ids == reference(cluster, prompt, 4)
        cluster.check_pages(idle=False)
    cluster.check_pages()
    assert cluster.prefill.status_fields().to_wire()["kv_pages"]["cached"] <= total


def test_flush_cache_is_refused_while_requests_run_and_frees_pages_after(cluster):
    rid = cluster.submit(SYSTEM + [4], 30)
    cluster.until(lambda: rid in cluster.answers and cluster.answers[rid].token_ids)
    reply = cluster.admin("flush_cache")
    assert not reply["ok"] and any(w.get("status") == 409 for w in reply["workers"])
    cluster.run(rid)
    cluster.pump()
    reply = cluster.admin("flush_cache")
    assert reply["ok"] and {w["endpoint"]: w["flushed_pages"] for w in reply["workers"]} == {
        cluster.prefill.endpoint: 3, cluster.decode.endpoint: 3}      # both keep the prompt
    for core in (cluster.prefill, cluster.decode):
        pages = core.status_fields().to_wire()["kv_pages"]
        assert pages["cached"] == 0 and pages["free"] == pages["total"]


def test_release_memory_drops_the_cache_first(cluster):
    cluster.run(cluster.submit(SYSTEM + [4], 3))
    cluster.pump()
    assert cluster.admin("release_memory")["ok"]
    assert cluster.admin("resume_memory")["ok"]
    cluster.serves_again()


def test_retract_and_continue_stay_exact_with_a_cached_prefix(cluster):
    from engines.loader import load_model
    from tests.unit.test_handoff import continuation
    prompt = SYSTEM + [3, 1, 4]
    cluster.run(cluster.submit(prompt, 2))                  # the prefix is cached now
    rid = cluster.submit(prompt, 24)
    cluster.until(lambda: rid in cluster.answers and len(cluster.answers[rid].token_ids) >= 4)
    assert cluster.admin("pause", mode="retract")["ok"]
    before = list(cluster.answers[rid].token_ids)
    assert cluster.admin("update_weights", path="tiny:7", version="v2")["ok"]
    assert cluster.admin("continue")["ok"]
    got = cluster.run(rid)
    assert got.token_ids == continuation(load_model("tiny:7", dtype="float64"), prompt, before, 24)
    # the recompute under new weights found nothing cached; the request's figure stays
    assert got.meta["cached_tokens"] == 48
    cluster.check_pages()


# --- cached_tokens in the finish meta -------------------------------------------------


def hit_tokens(c: InprocCluster) -> int:
    return c.prefill.status_fields().to_wire()["counters"]["prefix_cache_hit_tokens"]


def test_cached_tokens_are_what_the_prefill_took_from_its_cache(cluster):
    """A cold prompt reports 0; one sharing a prefix with an earlier one reports the
    tokens the prefill's cache matched (whole pages, never the page of the last token),
    as the client's meta and as the router's running total."""
    cold = cluster.run(cluster.submit(SYSTEM + [1, 2, 3], 4))
    assert cold.meta["cached_tokens"] == 0 and hit_tokens(cluster) == 0
    total = 0
    for i, (prompt, want) in enumerate(((SYSTEM + [4, 5], 48), (SYSTEM[:40] + [9], 32),
                                        (SYSTEM, 32), ([250, 249, 248], 0))):
        before = hit_tokens(cluster)
        got = cluster.run(cluster.submit(prompt, 4, stream=i % 2 == 0))
        assert got.meta["cached_tokens"] == want == hit_tokens(cluster) - before, prompt
        assert got.token_ids == reference(cluster, prompt, 4)
        total += want
    assert cluster.admin("status")["counters"]["cached_tokens"] == total
    cluster.check_pages()


def test_cached_tokens_are_0_with_the_cache_off():
    off = InprocCluster(kv_cache_mb=2.0, prefix_cache=False)
    try:
        for _ in range(2):
            assert off.run(off.submit(SYSTEM + [1, 2], 3)).meta["cached_tokens"] == 0
        assert off.admin("status")["counters"]["cached_tokens"] == 0
    finally:
        off.close()


# --- cache-aware routing -------------------------------------------------------------------


def test_requests_that_begin_alike_go_to_the_same_prefill_unless_it_is_much_busier():
    from types import SimpleNamespace as W

    from zpd.router.affinity import SLACK, PrefixAffinity
    from zpd.wire.protocol import Generate
    a, b = W(endpoint="a", load=0), W(endpoint="b", load=0)
    aff = PrefixAffinity(max_entries=40)
    prompt = SYSTEM + [1, 2, 3]
    first = aff.pick(Generate("r", prompt), [a, b])
    other = b if first is a else a
    for _ in range(SLACK):                      # GRPO: the samples follow the first
        first.load += 1
        assert aff.pick(Generate("r", prompt), [a, b]) is first
    first.load += 1                             # SLACK + 1 > 2 * 0 + SLACK: too busy now
    assert aff.pick(Generate("r", prompt), [a, b]) is other
    first.load = other.load = 0
    turn = aff.pick(Generate("r", SYSTEM + [1, 2, 3, 50, 51, 52]), [a, b])
    assert turn is other                        # the next turn: where the prompt went last
    stranger = Generate("r", [9] * 40 + SYSTEM)
    picks = {aff.pick(stranger, [a, b]).endpoint for _ in range(20)}
    assert picks <= {"a", "b"}                  # nothing shared: by load
    assert len(aff.last) <= 40
    assert aff.pick(Generate("r", [], text="hello"), [a]) is a


# --- the decode's side: pages it holds are not sent again --------------------------------


def written(c: InprocCluster) -> int:
    return c.prefill.status_fields().to_wire()["counters"]["kv_bytes_written"]


def test_a_decode_holding_the_prefix_receives_only_the_rest(cluster):
    page_bytes = cluster.decode.layout.page_bytes
    first = SYSTEM + [1, 2, 3]                                # 51 tokens: 4 pages
    cluster.run(cluster.submit(first, 4))
    assert written(cluster) == 4 * page_bytes
    again = SYSTEM + [9, 9]
    got = cluster.run(cluster.submit(again, 6)).token_ids
    assert got == reference(cluster, again, 6)
    assert written(cluster) == 5 * page_bytes                # its 3 shared pages stayed put
    assert cluster.decode.status_fields().to_wire()["prefix_cache"]["hit_rate"] > 0
    cluster.check_pages()


def test_an_abort_mid_transfer_fences_only_the_pages_being_written(cluster):
    cluster.run(cluster.submit(SYSTEM + [1], 2))              # 3 pages cached on both sides
    cluster.silent.add("prefill")
    rid = cluster.submit(SYSTEM + [5, 6], 8)
    cluster.until(lambda: any(j.asked == 0 for j in cluster.decode.scheduler.jobs.values()))
    (job,) = cluster.decode.scheduler.jobs.values()
    assert job.skip == 3
    cluster.abort(rid)
    cluster.pump(3)
    fenced = cluster.decode.status_fields().to_wire()["kv_pages"]["fenced"]
    assert fenced == cluster.decode.pool.pages_for(job.req.max_context) - 3
    cluster.check_pages(idle=False)
    cluster.silent.clear()
    assert cluster.run(rid).status == 499
    cluster.pump(5)
    cluster.check_pages()
    cluster.serves_again(SYSTEM + [5, 6])


def test_off_means_off_on_both_sides():
    c = InprocCluster(kv_cache_mb=2.0, prefix_cache=False)
    try:
        for _ in range(2):
            c.run(c.submit(SYSTEM + [4], 3))
        for core in (c.prefill, c.decode):
            f = core.status_fields().to_wire()
            assert f["kv_pages"]["cached"] == 0 and f["prefix_cache"]["enabled"] is False
        assert written(c) == 2 * 4 * c.decode.layout.page_bytes
    finally:
        c.close()


def test_release_memory_while_retracted_drops_the_cache_too(cluster):
    cluster.run(cluster.submit(SYSTEM + [4], 3))
    rid = cluster.submit(SYSTEM + [5], 30)
    cluster.until(lambda: rid in cluster.answers and cluster.answers[rid].token_ids)
    assert cluster.admin("pause", mode="retract")["ok"]     # held: the decode is busy
    assert cluster.admin("release_memory")["ok"]
    assert cluster.admin("resume_memory")["ok"]
    assert cluster.admin("continue")["ok"]
    assert cluster.run(rid).token_ids == reference(cluster, SYSTEM + [5], 30)
    cluster.check_pages()


def test_samples_of_a_page_aligned_prompt_all_run_in_the_second_step(cluster):
    """48 tokens: the third page holds the last token, always computed, so no sample
    waits for another's third page: one step computes the prompt, the next all others."""
    steps = []
    real = cluster.prefill.compute.prefill
    cluster.prefill.compute.prefill = lambda reqs, starts=None: (steps.append(len(reqs)),
                                                                 real(reqs, starts))
    rids = [cluster.submit(SYSTEM, 4) for _ in range(6)]
    for rid in rids:
        assert cluster.run(rid).token_ids == reference(cluster, SYSTEM, 4)
    assert steps == [1, 5]
    assert computed_tokens(cluster) == 48 + 5 * 16
