"""Shared fixtures and the `slow` marker. Tests import the packages from the checkout.

`python3 -m pytest -q -m "not slow" tests` is the quick loop (README, "Tests"); CI runs
everything. Slow, by where a test lives: every e2e test (real processes, real Mooncake),
and the unit files and tests below, each of which takes seconds (a real model, a
subprocess, a reference implementation). A new test that takes a second or more
belongs here too (`--durations=20` shows them); the quick loop stays under 3 minutes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SLOW_DIRS = ("tests/e2e/",)
# transformers as the reference: its import and its GGUF loader take seconds.
SLOW_FIXTURES = frozenset({"smollm_ref", "hf_checkpoint"})
SLOW_FILES = frozenset({
    "tests/unit/test_smollm2.py",          # SmolLM2 against transformers
    "tests/unit/test_smollm2_prompt_logprobs.py",     # and its prompt logprobs
    "tests/unit/test_model_vs_hf.py",      # every architecture against transformers
    "tests/unit/test_gguf_moe.py",         # GGUF mixtures against their transformers checkpoints
    "tests/unit/test_weight_sync_moe.py",  # pushes of a mixture's experts into real workers
    "tests/unit/test_weight_sync_pool.py",  # pushes received in place, into real workers
    "tests/unit/test_moe_parallel.py",     # MoE under --tp / --ep against transformers
    "tests/unit/test_moe_parallel_workers.py",     # and workers of MoE ranks, processes by gloo
    "tests/unit/test_tp_workers.py",       # tensor-parallel ranks: processes joined by gloo
    "tests/unit/test_tp_security.py",      # and attacks on their group
    "tests/unit/test_tp_resume_failure.py",    # and their memory failing to come back
    "tests/unit/test_tp_frozen.py",        # and one stopped, waited out for seconds
    "tests/unit/test_routed_experts.py",   # routed experts against transformers' routers
    "tests/unit/test_routed_experts_pd.py",    # and through prefill and decode (MoE checkpoints)
    "tests/unit/test_routed_rows.py",          # and wider than a frame (MoE checkpoints)
    "tests/unit/test_grammar.py",          # constrained outputs of ~50 tokens through 1P1D
    "tests/unit/test_deterministic_smollm2.py",    # SmolLM2 in two dtypes, both modes
})
SLOW_TESTS = frozenset({
    # a sender process of its own, torch imported there (issue 46, item 1)
    "tests/unit/test_tensor_payload.py::test_file_descriptor_sharing_from_an_unrelated_sender_is_refused_with_the_fix",
    # a router's route attacked while its requests stream (issue 43, item 2)
    "tests/unit/test_route_theft.py::test_a_peer_that_names_the_routers_identity_gets_none_of_its_tokens",
    "tests/unit/test_route_theft.py::test_a_forged_adopt_between_a_routers_death_and_its_restart_gets_nothing",
    # the CPU kernels compiled from scratch into a fresh cache
    "tests/unit/test_cpu_kernels.py::test_built_once_then_loaded_from_the_cache",
    "tests/unit/test_cpu_kernels.py::test_a_cache_others_can_write_to_is_not_used",
    "tests/unit/test_cpu_kernels.py::test_one_source_failing_fails_the_build_and_leaves_nothing",
    "tests/unit/test_cpu_layer_ops.py::test_layer_ops_that_disagree_are_not_used",
    "tests/unit/test_cpu_products.py::test_prefills_take_silu_mul_in_the_product_where_the_kernel_does",
    "tests/unit/test_cpu_products.py::test_model_products_go_to_the_packed_kernels",
    "tests/unit/test_cpu_products.py::test_a_wrong_gated_kernel_is_not_used",
    # --deterministic: dozens of batches, both modes (issue 48)
    "tests/unit/test_deterministic.py::test_a_request_alone_equals_it_in_any_batch_at_any_position",
    "tests/unit/test_deterministic.py::test_seeded_sampling_is_the_same_in_any_batch",
    "tests/unit/test_deterministic.py::test_zpd_run_takes_the_flag_and_sglangs_alias",
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
    "tests/unit/test_weight_sync.py::test_packed_copies_never_outlive_the_weights_they_were_made_from",
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
    # ~1 s or more each (measured with --durations on a busy 2-core machine): real
    # sockets' timeouts and handshakes, kernels against float64, whole clusters in process
    "tests/unit/test_admin_input.py::test_bad_abort_rid_is_refused",
    "tests/unit/test_client.py::test_cli_generate_fails_fast_naming_the_address",
    "tests/unit/test_client.py::test_nothing_listening_fails_within_connect_timeout",
    "tests/unit/test_client.py::test_router_acknowledges_routed_queued_and_refused",
    "tests/unit/test_cpu_kernels.py::test_a_build_past_its_time_limit_fails_and_its_compilers_are_killed",
    "tests/unit/test_cpu_kernels.py::test_engine_decode_with_the_kernel_equals_torch_attention",
    "tests/unit/test_cpu_kernels.py::test_kernel_equals_float64_attention",
    "tests/unit/test_cpu_kernels.py::test_without_a_kernel_decode_stays_on_torch_with_a_warning",
    "tests/unit/test_cpu_products.py::test_a_packing_that_is_not_its_layout_is_not_used",
    "tests/unit/test_cpu_products.py::test_a_wrong_packed_kernel_is_not_used",
    "tests/unit/test_engine.py::test_text_prompt_without_tokenizer_is_clear_error",
    "tests/unit/test_forged_decode.py::test_continue_naming_bad_prefills_keeps_the_request_own_prefill",
    "tests/unit/test_forged_prefill.py::test_impossible_hello_is_refused",
    "tests/unit/test_gguf.py::test_a_file_without_a_tokenizer_serves_ids_and_names_the_problem",
    "tests/unit/test_gguf.py::test_a_worker_updates_from_gguf_and_refuses_a_bad_one",
    "tests/unit/test_gguf.py::test_each_architecture_loads_as_its_checkpoint",
    "tests/unit/test_gguf.py::test_update_weights_from_a_gguf_file",
    "tests/unit/test_http_router_client.py::test_no_acknowledgement_or_a_silent_router_ends_requests_with_503",
    "tests/unit/test_http_slow_reader.py::test_a_client_that_stops_reading_is_aborted_and_its_buffer_stays_bounded",
    "tests/unit/test_http_unread_streams.py::test_thirty_unread_streams_are_aborted_soon_and_hold_a_bounded_total",
    "tests/unit/test_last_tokens.py::test_generation_after_it_reads_the_last_layers_keys",
    "tests/unit/test_last_tokens.py::test_last_tokens_only_equal_every_token",
    "tests/unit/test_limits.py::test_max_batch_counts_requests_still_transferring",
    "tests/unit/test_logprobs.py::test_retraction_keeps_one_logprob_per_token",
    "tests/unit/test_responses_api.py::test_the_openai_client_creates_a_response_whole_and_streamed",
    "tests/unit/test_tool_calls.py::test_forced_grammar_takes_calls_by_the_schema_and_nothing_else",
    "tests/unit/test_tool_calls.py::test_tool_turns_render_as_transformers_renders_them",
    "tests/unit/test_logprobs.py::test_sampled_logprobs_are_before_truncation",
    "tests/unit/test_min_new_tokens.py::test_stop_token_ids_wait_for_min_new_tokens",
    "tests/unit/test_prefix_cache.py::test_release_memory_while_retracted_drops_the_cache_too",
    "tests/unit/test_prefix_cache.py::test_samples_of_a_page_aligned_prompt_all_run_in_the_second_step",
    "tests/unit/test_router_queue.py::test_a_client_past_its_share_waits_and_another_client_goes_first",
    "tests/unit/test_router_queue.py::test_a_waiting_request_is_abortable_and_its_rid_taken",
    "tests/unit/test_router_queue.py::test_at_most_max_concurrent_requests_are_routed_and_all_finish",
    "tests/unit/test_router_no_torch.py::test_zpd_admin_against_a_running_router_imports_no_torch",
    "tests/unit/test_router_probe.py::test_a_client_that_hung_up_loses_its_requests_at_the_next_heartbeat",
    "tests/unit/test_security.py::test_authorised_client_submits_but_cannot_administer",
    "tests/unit/test_security.py::test_plaintext_process_cannot_reach_a_keyed_one",
    "tests/unit/test_security.py::test_unknown_key_and_plaintext_are_refused",
    "tests/unit/test_security.py::test_worker_takes_requests_and_control_only_from_the_cluster_key",
    "tests/unit/test_tokenize_liveness.py::test_a_thread_keeps_ticking_while_a_megabyte_is_tokenized",
    "tests/unit/test_tp.py::test_zpd_run_over_ranks_equals_one_rank",      # processes joined by gloo
    "tests/unit/test_weight_sync.py::test_retract_push_continue_is_old_then_new_weights",
    "tests/unit/test_weight_sync_faults.py::test_the_workers_weight_sync_timeout_caps_a_longer_admin_timeout",
    "tests/unit/test_weight_sync_faults.py::test_a_worker_that_dies_mid_push_ends_the_push_when_it_is_marked_dead",
    "tests/unit/test_weight_sync_sglang.py::test_a_stuck_join_is_answered_in_real_time",
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
