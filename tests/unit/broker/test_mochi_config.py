"""The translation of a rendered Mosquitto profile into shoal-mochi's JSON configuration."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from shoal.broker._mochi import UNMAPPED, mochi_config, options
from shoal.broker.access import BrokerUser, Role
from shoal.broker.embedded import MOCHI_STORE_LOAD_S, EmbeddedBroker
from shoal.broker.profiles import fill, profile_template
from shoal.errors import ConfigError
from shoal.schemas.topics import Topics

VALUES = {
    "port": "1883",
    "bind": "127.0.0.1",
    "data_dir": "/d",
    "log_file": "/d/log",
    "password_file": "/d/passwd",
    "acl_file": "/d/acl",
    "user": "me",
    "tls_port": "8883",
    "tls_bind": "0.0.0.0",
    "tls_ca_file": "/t/ca.crt",
    "tls_cert_file": "/t/server.crt",
    "tls_key_file": "/t/server.key",
    "tls_require_certificate": "true",
}


def _rendered(profile: str) -> str:
    source, template = profile_template(profile)
    return fill(template, VALUES, source)


def test_the_dev_profile_is_one_open_listener_with_persistence() -> None:
    config = mochi_config(_rendered("dev"), [], Topics(), Path("/d"), Path("/d/log"))
    assert config["listen"] == ["127.0.0.1:1883"]
    assert config["tls"] == []
    assert (config["allow_anonymous"], config["authenticate"], config["acl"]) == (
        True,
        False,
        False,
    )
    assert config["maximum_packet_size"] == 16 * 1024 * 1024
    assert config["store_file"] == "/d/mochi.db"
    assert config["sys_interval"] == 1
    assert config["maximum_message_expiry_interval"] == 0  # Mochi's default would be 24 h


def test_the_secure_profile_brings_tls_users_and_their_rules() -> None:
    topics = Topics(root="site")
    users = [BrokerUser("gw-1", "pw", Role.gateway()), BrokerUser("nobody", "pw2")]
    config = mochi_config(_rendered("secure"), users, topics, Path("/d"), Path("/d/log"))
    assert config["listen"] == ["127.0.0.1:1883"]
    assert config["tls"] == [
        {
            "address": "0.0.0.0:8883",
            "ca_file": "/t/ca.crt",
            "cert_file": "/t/server.crt",
            "key_file": "/t/server.key",
            "require_client_certificate": True,
        }
    ]
    assert (config["allow_anonymous"], config["authenticate"], config["acl"]) == (
        False,
        True,
        True,
    )
    gateway, nobody = config["users"]  # type: ignore[misc]
    assert gateway["rules"] == [
        {"access": rule.access, "topic": rule.topic}
        for rule in Role.gateway().rules("gw-1", topics)
    ]
    assert nobody["rules"] == []
    digest = hashlib.sha256((gateway["salt"] + "pw").encode()).hexdigest()
    assert gateway["password_sha256"] == digest
    assert "pw" not in str(config)


def test_every_option_of_every_profile_is_translated_or_listed_as_unmapped() -> None:
    for profile in ("dev", "edge", "secure"):
        names = {option for option, _ in options(_rendered(profile))}
        assert names, profile
        mochi_config(_rendered(profile), [], Topics(), Path("/d"), Path("/d/log"))
    assert "max_queued_bytes" in UNMAPPED


def test_an_option_without_an_equivalent_is_refused() -> None:
    with pytest.raises(ConfigError, match="no equivalent for Mosquitto's 'bridge_protocol'"):
        mochi_config("bridge_protocol mqttv50\n", [], Topics(), Path("/d"), Path("/d/log"))


def test_a_mochi_restarted_on_a_store_is_given_longer_to_listen(tmp_path: Path) -> None:
    # Mochi reads its whole store before it listens (a chaos run's backlog took 15 s).
    mochi = EmbeddedBroker("dev", data_dir=tmp_path, broker="mochi", startup_timeout_s=10.0)
    mosquitto = EmbeddedBroker("dev", data_dir=tmp_path, broker="mosquitto", startup_timeout_s=10.0)
    assert mochi.listen_timeout_s() == 10.0  # a first start: no store yet
    (tmp_path / "mochi.db").write_bytes(b"\0" * 4096)
    assert mochi.listen_timeout_s() == MOCHI_STORE_LOAD_S
    assert mosquitto.listen_timeout_s() == 10.0
