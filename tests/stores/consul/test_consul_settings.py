"""What a consul:// URL and the CONSUL_* environment configure (no store needed)."""

from __future__ import annotations

import pytest

from celery_exclusive.backends.consul import encode, format_duration, settings_from_url
from celery_exclusive.backends.consul.kv import Layout, decode
from celery_exclusive.backends.consul.session import create_body, lock_delay_for
from celery_exclusive.errors import ConfigurationError
from tests.support.consul_emulator import clean_path, parse_go_duration


def test_url_gives_address_token_dc_namespace_partition_and_session_options():
    settings = settings_from_url(
        "consuls://consul.example:8443/tenants/a?token=t0k&dc=eu1&ns=team&partition=p1"
        "&behavior=release&lock_delay=2.5",
        environ={"CONSUL_HTTP_ADDR": "elsewhere:1", "CONSUL_HTTP_TOKEN": "env"},
    )
    assert settings.base_url == "https://consul.example:8443"
    assert (settings.token, settings.dc, settings.root) == ("t0k", "eu1", "tenants/a/")
    assert settings.query() == {"dc": "eu1", "ns": "team", "partition": "p1"}
    assert (settings.behavior, settings.lock_delay) == ("release", 2.5)


def test_an_empty_url_falls_back_to_the_environment_then_defaults():
    env = {"CONSUL_HTTP_ADDR": "https://10.0.0.5:8501", "CONSUL_HTTP_TOKEN": "env-token"}
    settings = settings_from_url("consul://", environ=env)
    assert (settings.base_url, settings.token) == ("https://10.0.0.5:8501", "env-token")
    assert settings.behavior == "delete" and settings.lock_delay is None
    bare = settings_from_url("consul://", environ={"CONSUL_HTTP_ADDR": "127.0.0.2:9500"})
    assert (bare.base_url, bare.token) == ("http://127.0.0.2:9500", None)
    assert settings_from_url("consuls://", environ={}).base_url == "https://127.0.0.1:8501"


def test_ipv6_hosts_from_the_url_and_the_environment():
    assert settings_from_url("consul://[::1]:8500", environ={}).base_url == "http://[::1]:8500"
    env = {"CONSUL_HTTP_ADDR": "[fd00::5]:8501"}
    assert settings_from_url("consul://", environ=env).base_url == "http://[fd00::5]:8501"


def test_tls_files_come_from_the_url_or_the_consul_environment(tmp_path):
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("x")
    env = {
        "CONSUL_CACERT": str(tmp_path / "ca.pem"),
        "CONSUL_CLIENT_CERT": str(tmp_path / "cert.pem"),
        "CONSUL_CLIENT_KEY": str(tmp_path / "key.pem"),
    }
    from_env = settings_from_url("consuls://h:8501", environ=env)
    assert (from_env.cacert, from_env.client_cert, from_env.client_key) == tuple(env.values())
    url = f"consuls://h:8501?cacert={tmp_path}/cert.pem"
    assert settings_from_url(url, environ=env).cacert == str(tmp_path / "cert.pem")


@pytest.mark.parametrize(
    "query, names",
    [
        ("behavior=keep", "behavior"),
        ("lock_delay=-1", "lock_delay"),
        ("lock_delay=soon", "lock_delay"),
        ("lock_delay=61", "60"),
        ("ttl=5", "ttl"),
        ("cacert=/nowhere/ca.pem", "cacert"),
    ],
)
def test_bad_url_options_are_configuration_errors_naming_them(query, names):
    with pytest.raises(ConfigurationError, match=names):
        settings_from_url(f"consul://h:8500?{query}", environ={})


def test_a_client_certificate_needs_its_key(tmp_path):
    (tmp_path / "cert.pem").write_text("x")
    with pytest.raises(ConfigurationError, match="client_key"):
        settings_from_url(f"consuls://h?client_cert={tmp_path}/cert.pem", environ={})


@pytest.mark.parametrize("path", ["/a//b", "/a/./b", "/a/../b"])
def test_a_kv_folder_a_router_would_rewrite_is_refused(path):
    with pytest.raises(ConfigurationError, match="KV folder"):
        settings_from_url(f"consul://h:8500{path}", environ={})


# --- durations Go reads back ------------------------------------------------------------


@pytest.mark.parametrize("seconds", [0, 0.00001, 0.0004, 0.25, 1.5, 10, 60, 86400])
def test_durations_are_sent_as_whole_milliseconds_go_parses(seconds):
    text = format_duration(seconds)
    parsed = parse_go_duration(text)
    assert parsed is not None and abs(parsed - seconds) <= 0.0005
    # Consul reads a lock delay under 1000 ns as seconds: never send one.
    assert parsed == 0 or parsed >= 0.001


def test_sessions_are_unbound_from_node_checks_and_carry_the_lock_delay():
    body = create_body("w", 12, "delete", lock_delay_for(12, None))
    assert body["Checks"] == [] and body["NodeChecks"] == []
    assert body["TTL"] == "12000ms" and body["LockDelay"] == "14000ms"


def test_the_default_lock_delay_covers_a_renewal_interval_and_a_request_capped_at_60s():
    assert lock_delay_for(30, None) == 30 / 3 + 10
    assert lock_delay_for(3600, None) == 60
    assert lock_delay_for(30, 0.0) == 0.0


# --- keys into paths --------------------------------------------------------------------

KEYS = ["k", "", "exclusive:invoice:1", "a//b", "a/./b", "../up", "k/", "100%", "_5F", "ключ ü\n"]


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_a_key_becomes_one_segment_no_router_rewrites_and_decodes_back(key):
    segment = encode(key)
    assert segment and set(segment) <= set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    )
    assert decode(segment) == key
    path = "/v1/kv/" + Layout("root/").lock(key)
    assert clean_path(path) == path


def test_the_encoding_keeps_prefixes_and_only_prefixes():
    assert encode("invoice:1xxxx").startswith(encode("invoice:1"))
    assert not encode("invoice:2").startswith(encode("invoice:1"))
    assert not Layout("").folder("invoice:1xxxx").startswith(Layout("").folder("invoice:1"))
