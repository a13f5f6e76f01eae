"""A process that binds a network address without CURVE keys refuses to start unless
told --insecure (issue #11, finding 1): anyone who reaches an open port could
otherwise send update_weights, release_memory or pause."""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zpd.ops.cli import build_parser, main
from zpd.ops.exposure import ExposureError, check_bind, is_loopback
from zpd.ops.options import router_config, worker_argv, worker_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost",
                                  "::ffff:127.0.0.1", "inproc://x"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)
    check_bind("router", host, None, False)          # no keys needed


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "*", "10.0.0.1", "192.168.1.7", "fe80::1",
                                  "2001:db8::1", "no-such-host.invalid"])
def test_network_hosts(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ExposureError) as e:
        check_bind("prefill", host, None, False)
    assert repr(host) in str(e.value) and "--curve-keys" in str(e.value) \
        and "--insecure" in str(e.value)


def test_keys_or_insecure_allow_a_network_host(caplog: pytest.LogCaptureFixture) -> None:
    check_bind("decode", "0.0.0.0", "/keys", False)
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        check_bind("decode", "10.0.0.1", None, True)
    assert "10.0.0.1" in caplog.text and "--insecure" in caplog.text


@pytest.mark.parametrize("argv", [
    ["router", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
    ["prefill", "--model", "tiny"],
    ["decode", "--model", "tiny"],
    ["launch", "--model", "tiny"],
])
def test_every_serving_command_refuses_before_it_binds(argv, capsys) -> None:
    assert main(argv + ["--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"zpd {argv[0]}: error: refusing to bind '0.0.0.0'" in err and "--insecure" in err


def test_insecure_reaches_the_configs_and_launch_passes_it_on() -> None:
    parse = build_parser().parse_args
    assert worker_config(parse(["prefill", "--model", "tiny", "--insecure"]), "prefill").insecure
    assert not worker_config(parse(["decode", "--model", "tiny"]), "decode").insecure
    assert router_config(parse(["router", "--prefill", "a:1", "--decode", "b:2",
                                "--insecure"])).insecure
    argv = worker_argv(parse(["launch", "--model", "tiny", "--insecure"]))
    assert "--insecure" in argv and "True" not in argv
    assert worker_config(parse(["decode", *argv]), "decode").insecure
    assert "--insecure" not in worker_argv(parse(["launch", "--model", "tiny"]))


def test_router_on_a_wildcard_address_exits_2_at_once() -> None:
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "zpd", "router", "--host", "0.0.0.0",
                              "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the router started on 0.0.0.0 without keys or --insecure")
    assert out.returncode == 2, out.stderr
    assert "refusing to bind '0.0.0.0'" in out.stderr and "--curve-keys" in out.stderr \
        and "--insecure" in out.stderr
    assert time.monotonic() - started < 30
