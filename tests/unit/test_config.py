"""The config dataclasses are the one source of defaults: the CLI's flags, their
--help and `zpd launch`'s forwarded worker flags all come from them."""
from __future__ import annotations

import argparse

import pytest

from zpd.config import Deadlines, PromptLimits, RouterConfig, WorkerConfig, default_of
from zpd.ops.cli import build_parser
from zpd.ops.launch import split_cores
from zpd.ops.options import ROUTER_ENDPOINT, router_argv, router_config, worker_argv, worker_config


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_flags_default_to_the_dataclass(role: str) -> None:
    assert worker_config(parse(role, "--model", "tiny"), role) == WorkerConfig(role, "tiny")


def test_router_flags_default_to_the_dataclass() -> None:
    args = parse("router", "--prefill", "a:1,", "--decode", "b:2,c:3")
    assert router_config(args) == RouterConfig(("a:1",), ("b:2", "c:3"))
    assert (RouterConfig((), ()).port, ROUTER_ENDPOINT) == (5757, "127.0.0.1:5757")


def test_router_needs_an_endpoint_of_each_role() -> None:
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        router_config(parse("router", "--prefill", ",", "--decode", "b:2"))


def test_each_flag_reaches_its_field() -> None:
    args = parse("decode", "--model", "m", "--host", "0.0.0.0", "--port", "7", "--page-size", "32",
                 "--kv-cache-mb", "8", "--max-batch", "3", "--max-prefill-tokens", "99",
                 "--transfer-timeout", "4", "--kv-wait-timeout", "5", "--dead-fence", "6",
                 "--heartbeat", "0.25", "--peer-timeout", "1.5", "--dtype", "float64")
    cfg = worker_config(args, "decode")
    assert (cfg.host, cfg.port, cfg.page_size, cfg.kv_cache_mb, cfg.max_batch,
            cfg.max_prefill_tokens, cfg.dtype) == ("0.0.0.0", 7, 32, 8.0, 3, 99, "float64")
    assert cfg.deadlines == Deadlines(kv_wait=5.0, transfer=4.0, heartbeat=0.25,
                                      peer_timeout=1.5, dead_fence=6.0)


def test_one_kv_wait_covers_every_phase_wait() -> None:
    d = Deadlines(kv_wait=7.0)
    assert (d.wait_kv_dest, d.wait_pages, d.wait_kv_done, d.stash) == (7.0,) * 4
    assert Deadlines().wait_kv_dest == 60.0


def test_launch_forwards_its_worker_flags_unchanged() -> None:
    defaults = worker_argv(parse("launch", "--model", "tiny"))
    assert worker_config(parse("prefill", *defaults), "prefill") == WorkerConfig("prefill", "tiny")
    tuned = worker_argv(parse("launch", "--model", "tiny", "--kv-wait-timeout", "9",
                              "--ib-device", "mlx5_0", "--curve-keys", "/k"))
    cfg = worker_config(parse("decode", *tuned), "decode")
    assert (cfg.deadlines.kv_wait, cfg.ib_device, cfg.curve_keys) == (9.0, "mlx5_0", "/k")


def help_text(capsys: pytest.CaptureFixture, command: str) -> str:
    with pytest.raises(SystemExit):
        parse(command, "--help")
    return " ".join(capsys.readouterr().out.split())


def test_help_shows_the_dataclass_defaults(capsys: pytest.CaptureFixture) -> None:
    worker_help = help_text(capsys, "prefill")
    for text in (f"tokens per KV page (default {default_of(WorkerConfig, 'page_size')})",
                 f"504 (default {default_of(Deadlines, 'kv_wait'):g})",
                 f"every peer (default {default_of(Deadlines, 'heartbeat'):g})",
                 f"(default {default_of(WorkerConfig, 'port')}: any free port)"):
        assert text in worker_help
    router_port = default_of(RouterConfig, "port")
    assert f"port to bind (default {router_port})" in help_text(capsys, "router")
    assert f"router port (default {router_port}; 0 = any)" in help_text(capsys, "launch")


def test_default_of() -> None:
    assert default_of(WorkerConfig, "deadlines") == Deadlines()
    with pytest.raises(ValueError, match="no default"):
        default_of(WorkerConfig, "model")
    with pytest.raises(AttributeError, match="no field"):
        default_of(WorkerConfig, "colour")


def test_limit_flags_reach_router_and_workers_through_launch() -> None:
    la = parse("launch", "--model", "tiny", "--max-text-bytes", "100", "--max-input-ids", "50",
               "--max-client-requests", "7", "--max-client-tokens", "900",
               "--max-concurrent-requests", "12", "--queue-size", "34", "--queue-timeout", "5.5")
    assert worker_config(parse("decode", *worker_argv(la)), "decode").prompt_limits == \
        PromptLimits(100, 50)
    r = router_config(parse("router", "--prefill", "a:1", "--decode", "b:2", *router_argv(la)))
    assert (r.prompt_limits, r.max_client_requests, r.max_client_tokens) == \
        (PromptLimits(100, 50), 7, 900)
    assert (r.max_concurrent_requests, r.queue_size, r.queue_timeout) == (12, 34, 5.5)
    auto = parse("launch", "--model", "tiny", "--decode", "3", "--max-batch", "8")
    assert router_config(parse("router", "--prefill", "a:1", "--decode", "b:2",
                               *router_argv(auto))).max_concurrent_requests == 24
    assert router_argv(parse("launch", "--model", "tiny")) == [
        "--max-text-bytes", str(1 << 20), "--max-input-ids", str(1 << 20),
        "--max-client-requests", "1024", "--max-client-tokens", str(1 << 22),
        "--max-concurrent-requests", "64", "--queue-size", str(1 << 14), "--queue-timeout", "300.0",
        "--busy-poll-us", str(default_of(RouterConfig, "busy_poll_us"))]


def test_routers_share_the_decodes_batches_and_a_follower_names_its_coordinator() -> None:
    two = parse("launch", "--model", "tiny", "--decode", "3", "--max-batch", "8", "--routers", "2")
    r = router_config(parse("router", "--prefill", "a:1", "--decode", "b:2", *router_argv(two),
                            "--coordinator", "h:5757"))
    assert (r.max_concurrent_requests, r.coordinator) == (12, "h:5757")
    assert router_config(parse("router", "--prefill", "a:1", "--decode", "b:2")).coordinator is None
    with pytest.raises(ValueError, match="--coordinator 'h' is not HOST:PORT"):
        router_config(parse("router", "--prefill", "a:1", "--decode", "b:2", "--coordinator", "h"))


def test_busy_poll_reaches_the_router_and_workers_through_launch() -> None:
    la = parse("launch", "--model", "tiny", "--busy-poll-us", "250")
    assert worker_config(parse("decode", *worker_argv(la)), "decode").deadlines.busy_poll_us == 250
    r = router_config(parse("router", "--prefill", "a:1", "--decode", "b:2", *router_argv(la)))
    assert r.busy_poll_us == 250


def test_a_prompt_cap_past_one_wire_frame_is_refused() -> None:
    with pytest.raises(ValueError, match="max_text_bytes"):
        worker_config(parse("prefill", "--model", "m", "--max-text-bytes", str(1 << 30)), "prefill")


# --- zpd launch: the default split of the host's cores among its workers -------------

def test_launch_splits_the_cores_and_binds_each_worker_to_its_own() -> None:
    none = {"prefill": None, "decode": None}
    assert split_cores([0, 1], ["prefill", "decode"], none, bind=True) == [(1, [0]), (1, [1])]
    assert split_cores(list(range(16)), ["prefill", "decode"], none, bind=True) == \
        [(8, list(range(8))), (8, list(range(8, 16)))]
    # cores that do not divide evenly: equal whole shares, the rest left to the router
    assert split_cores([0, 1, 2, 3, 4], ["prefill", "decode"], none, bind=False) == \
        [(2, None), (2, None)]
    # only an affinity subset may be used
    assert split_cores([4, 6], ["prefill", "decode"], none, bind=True) == [(1, [4]), (1, [6])]


def test_launch_split_with_more_workers_than_cores_gives_one_thread_each_unbound() -> None:
    plan = split_cores([0, 1], ["prefill"] * 2 + ["decode"] * 2, {"prefill": None, "decode": None},
                       bind=True)
    assert plan == [(1, None)] * 4


def test_launch_split_respects_an_explicit_thread_count() -> None:
    plan = split_cores(list(range(8)), ["prefill", "decode", "decode"], {"prefill": 4, "decode": None},
                       bind=True)
    assert plan == [(4, None), (2, [4, 5]), (2, [6, 7])]
    too_many = split_cores([0, 1], ["prefill", "decode"], {"prefill": 3, "decode": None}, bind=True)
    assert too_many == [(3, None), (1, None)]
