"""How `zpd http` and `zpd launch` take their API keys (issue 30, items 8 and 10): from a
file or the environment instead of a command line every local user can read, and an
admin key only where CURVE keeps local processes from going around it."""
from __future__ import annotations

import logging
import os

import pytest

from zpd.ops.cli import build_parser
from zpd.ops.exposure import ExposureError
from zpd.ops.http_options import http_config


def config(*flags: str):
    return http_config(build_parser().parse_args(["http", "--model", "tiny", *flags]))


def key_file(tmp_path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "key"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_keys_come_from_files_stripped(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("ZPD_API_KEY", raising=False)
    monkeypatch.delenv("ZPD_ADMIN_API_KEY", raising=False)
    user = key_file(tmp_path, "  s3cret\n")
    admin = tmp_path / "admin"
    admin.write_text("adm1n\nsecond line ignored\n")
    os.chmod(admin, 0o600)
    cfg = config("--api-key-file", user, "--admin-api-key-file", str(admin), "--insecure")
    assert (cfg.api_key, cfg.admin_api_key) == ("s3cret", "adm1n")
    assert not [r for r in caplog.records if "readable by every" in r.getMessage()]


def test_a_world_readable_key_file_is_warned_about(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    assert config("--api-key-file", key_file(tmp_path, "k", 0o644)).api_key == "k"
    assert any("readable by every local user" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("flags, says", [
    (("--api-key-file", "/nonexistent/key"), "No such file"),
    (("--api-key", "a", "--api-key-file", "{file}"), "not both"),
    (("--api-key-file", "{empty}"), "is empty"),
])
def test_bad_key_files_stop_the_start(tmp_path, flags, says):
    files = {"{file}": key_file(tmp_path, "k"), "{empty}": str(tmp_path / "empty")}
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ExposureError, match=says):
        config(*(files.get(f, f) for f in flags))


def test_the_environment_gives_the_keys(monkeypatch):
    monkeypatch.setenv("ZPD_API_KEY", "from-env")
    assert config().api_key == "from-env"
    assert config("--api-key", "flag").api_key == "flag"


def test_an_admin_key_needs_curve_keys_or_insecure(tmp_path, monkeypatch):
    monkeypatch.delenv("ZPD_ADMIN_API_KEY", raising=False)
    with pytest.raises(ExposureError, match="any local process can send"):
        config("--admin-api-key", "a")
    assert config("--admin-api-key", "a", "--insecure").admin_api_key == "a"
    assert config("--admin-api-key", "a", "--curve-keys", str(tmp_path)).admin_api_key == "a"
    monkeypatch.setenv("ZPD_ADMIN_API_KEY", "a")
    with pytest.raises(ExposureError):
        config()


def test_launch_refuses_an_admin_key_without_curve_before_starting_anything(monkeypatch):
    import zpd.ops.launch
    monkeypatch.delenv("ZPD_ADMIN_API_KEY", raising=False)
    started = []
    monkeypatch.setattr(zpd.ops.launch, "launch", lambda *a: started.append(a) or 0)
    args = build_parser().parse_args(["launch", "--model", "tiny", "--http-port", "0",
                                      "--admin-api-key", "a"])
    with pytest.raises(ExposureError):
        args.func(args)
    assert not started


def test_launch_hands_file_keys_to_its_front_by_environment(tmp_path, monkeypatch):
    import zpd.ops.launch as launch
    seen = {}

    class Child:
        def __init__(self, role, argv, ready, log, env=None, cpus=None):
            seen.update(argv=argv, env=env)
    monkeypatch.setattr(launch, "Child", Child)
    args = build_parser().parse_args(["launch", "--model", "tiny", "--http-port", "0",
                                      "--api-key-file", key_file(tmp_path, "filekey"),
                                      "--header-timeout", "3"])
    launch._start_http(args, ["python"], "127.0.0.1:1", tmp_path, None)
    assert seen["env"]["ZPD_API_KEY"] == "filekey"
    assert "filekey" not in " ".join(seen["argv"]) and "--api-key-file" not in seen["argv"]
    assert float(seen["argv"][seen["argv"].index("--header-timeout") + 1]) == 3
