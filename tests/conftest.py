"""Shared fixtures and the `slow` marker. Tests import the packages from the checkout.

`python3 -m pytest -q -m "not slow" tests` is the quick loop (README, "Tests"); CI runs
everything. Slow, by where a test lives: every e2e test (real processes, real Mooncake),
and the unit files and tests below, each of which takes seconds (a real model, a
subprocess, a reference implementation). A new test that takes more than ~2 s belongs
here too (`--durations=20` shows them)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SLOW_DIRS = ("tests/e2e/",)
# transformers as the reference: its import and its GGUF loader take seconds.
SLOW_FIXTURES = frozenset({"smollm_ref"})
SLOW_FILES = frozenset({
    "tests/unit/test_smollm2.py",          # SmolLM2 against transformers
    "tests/unit/test_model_vs_hf.py",      # every architecture against transformers
})
SLOW_TESTS = frozenset({
    # the CPU kernels compiled from scratch into a fresh cache
    "tests/unit/test_cpu_kernels.py::test_built_once_then_loaded_from_the_cache",
    "tests/unit/test_cpu_kernels.py::test_a_cache_others_can_write_to_is_not_used",
    "tests/unit/test_cpu_kernels.py::test_one_source_failing_fails_the_build_and_leaves_nothing",
    "tests/unit/test_cpu_layer_ops.py::test_layer_ops_that_disagree_are_not_used",
    "tests/unit/test_cpu_products.py::test_prefills_take_silu_mul_in_the_product_where_the_kernel_does",
    "tests/unit/test_cpu_products.py::test_model_products_go_to_the_packed_kernels",
    "tests/unit/test_cpu_products.py::test_a_wrong_gated_kernel_is_not_used",
    # whole models, many steps, several dtypes
    "tests/unit/test_engine.py::test_dtypes_run",
    "tests/unit/test_engine.py::test_eos_ends_unless_ignored",
    "tests/unit/test_engine.py::test_batch_equals_each_prompt_alone",
    "tests/unit/test_engine.py::test_packed_weights_follow_every_update",
    "tests/unit/test_engine.py::test_weight_update_equals_fresh_load",
    "tests/unit/test_prefix_cache.py::test_eviction_under_pressure_keeps_outputs_exact",
    "tests/unit/test_prefix_cache.py::test_greedy_with_the_cache_equals_without_it",
    "tests/unit/test_min_new_tokens.py::test_no_eos_finish_before_min_new_tokens",
    "tests/unit/test_weight_release.py::test_a_refused_release_releases_nothing",
    "tests/unit/test_weight_release.py::test_released_weights_free_their_memory_and_come_back_bit_for_bit",
    "tests/unit/test_weight_sync.py::test_a_push_into_a_float32_or_bfloat16_model",
    "tests/unit/test_weight_sync.py::test_push_while_idle_moves_every_worker",
    "tests/unit/test_chat_requests.py::test_zpd_run_chat_prints_the_answer",
    # thousands of random inputs
    "tests/unit/test_protocol.py::test_fuzz_plausible_headers",
    "tests/unit/test_admin_records.py::test_fuzz_hostile_arguments_only_ever_raise_bad_args",
    "tests/unit/test_http_fuzz.py::test_random_requests_get_4xx_or_2xx_never_5xx_nor_a_hang",
    # deadlines and timeouts waited out on the clock
    "tests/unit/test_router_queue.py::test_queue_timeout_is_503_on_the_routers_clock",
    "tests/unit/test_weight_sync_sglang.py::test_a_join_that_never_completes_fails_in_time_and_a_retry_works",
    "tests/unit/test_weight_sync_faults.py::test_a_join_to_a_silent_port_is_bounded_and_a_retry_works_at_once",
    "tests/unit/test_weight_sync_faults.py::test_a_stalled_push_fails_within_the_timeout",
    "tests/unit/test_tokenize_liveness.py::test_a_thread_gets_turns_while_a_megabyte_of_ids_is_decoded",
    "tests/unit/test_tokenize_liveness.py::test_a_worker_answers_pings_while_it_tokenizes_a_megabyte",
})


def is_slow(nodeid: str, fixtures: tuple[str, ...] = ()) -> bool:
    """nodeid as pytest writes it from the repository root: path::name[params]."""
    path, _, name = nodeid.partition("::")
    return (path.startswith(SLOW_DIRS) or path in SLOW_FILES or bool(SLOW_FIXTURES & set(fixtures))
            or f"{path}::{name.split('[')[0]}" in SLOW_TESTS)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if is_slow(item.nodeid, tuple(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.slow)
