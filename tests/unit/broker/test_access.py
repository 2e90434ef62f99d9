"""Roles become ACL lines derived from the topic names; users and users files are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.broker.access import BrokerUser, Role, render_acl, users_from_config
from shoal.broker.acl import Rule
from shoal.broker.settings import BrokerSettings, TlsSettings
from shoal.errors import ConfigError
from shoal.schemas.topics import Topics, topic_matches

ROOT = Topics(root="site-7")


def lines(role: Role, user: str = "u") -> set[str]:
    return {rule.line() for rule in role.rules(user, ROOT)}


def test_gateway_rules_are_its_own_topics() -> None:
    assert lines(Role.gateway(), "gw-1") == {
        "topic write site-7/ingest/+/gw-1",
        "topic write site-7/shoal/gateway/gw-1",
        "topic read site-7/shoal/confirm/gw-1/#",
    }
    concentrator = lines(Role.gateway("a", "b"), "box")
    assert "topic write site-7/ingest/+/a" in concentrator
    assert "topic read site-7/shoal/confirm/b/#" in concentrator
    assert not any("box" in line for line in concentrator)


def test_pipeline_roles_are_scoped_to_their_pipeline() -> None:
    worker = lines(Role.worker("p", inputs=("ingest/plant/+",)))
    assert "topic read site-7/ingest/plant/+" in worker
    assert "topic write site-7/shoal/partials/p/+" in worker
    combiner = lines(Role.combiner("p"))
    assert "topic write site-7/shoal/confirm/+/p/+" in combiner
    assert "topic write site-7/results/p/#" in combiner
    for line in worker | combiner:
        topic = line.split()[-1]
        assert topic.startswith("site-7/")
        assert "/q/" not in topic


def test_every_rule_covers_the_topics_the_components_use() -> None:
    """The rules match the names topics.py gives (no hand-copied topic strings)."""

    def allowed(role: Role, access: str, topic: str, user: str = "u") -> bool:
        return any(
            rule.access in (access, "readwrite") and topic_matches(rule.topic, topic)
            for rule in role.rules(user, ROOT)
        )

    assert allowed(Role.gateway(), "write", ROOT.ingest("plant", "gw"), "gw")
    assert allowed(Role.gateway(), "read", ROOT.confirm("gw", "p", 3), "gw")
    assert not allowed(Role.gateway(), "read", ROOT.confirm("gw2", "p", 3), "gw")
    assert allowed(Role.worker("p"), "write", ROOT.partials("p", 17))
    assert allowed(Role.worker("p"), "write", ROOT.deadletter("p"))
    assert allowed(Role.worker("p"), "read", ROOT.control("shoal-worker-p-host-1-0-ab12"))
    assert not allowed(Role.worker("p"), "write", ROOT.partials("q", 0))
    assert not allowed(Role.worker("p"), "read", ROOT.pipeline_document("p"))
    pool = Role.worker(None)  # the pool: every pipeline, and the documents that name them
    assert allowed(pool, "write", ROOT.partials("q", 5))
    assert allowed(pool, "write", ROOT.deadletter("q"))
    assert allowed(pool, "read", ROOT.pipeline_document("q"))
    assert allowed(pool, "read", ROOT.pool_combiner("pc-1"))  # drops versions nobody computes
    assert not allowed(Role.worker("q"), "read", ROOT.pool_combiner("pc-1"))
    assert allowed(pool, "read", ROOT.ingest("plant", "gw"))
    assert not allowed(pool, "write", ROOT.pipeline_document("q"))
    assert not allowed(pool, "read", ROOT.pipeline_request("admin-1"))
    assert not allowed(pool, "write", ROOT.results("q"))
    assert allowed(Role.combiner("p"), "read", ROOT.partials("p", 3))
    assert allowed(Role.combiner("p"), "write", ROOT.confirm("gw", "p", 3))
    assert allowed(Role.combiner("p"), "write", ROOT.result_key("p", "a key"))
    assert allowed(Role.combiner("p"), "write", ROOT.results_encoded("p", "msgpack"))
    assert not allowed(Role.combiner("p"), "write", ROOT.confirm("gw", "q", 3))
    # Its dead letters: partials over the state cap, result rows no message can carry.
    assert allowed(Role.combiner("p"), "write", ROOT.deadletter("p"))
    assert not allowed(Role.combiner("p"), "write", ROOT.deadletter("q"))
    combiners = Role.combiner(None)  # the pool: every pipeline, its membership and documents
    for pipeline in ("p", "q"):
        assert allowed(combiners, "read", ROOT.partials(pipeline, 2))
        assert allowed(combiners, "read", ROOT.combiner_control(pipeline))
        assert allowed(combiners, "write", ROOT.results(pipeline))
        assert allowed(combiners, "write", ROOT.result_key(pipeline, "k"))
        assert allowed(combiners, "write", ROOT.confirm("gw", pipeline, 1))
        assert allowed(combiners, "write", ROOT.late(pipeline))
        assert allowed(combiners, "write", ROOT.alert(pipeline, "hot", "k"))
        assert allowed(combiners, "write", ROOT.deadletter(pipeline))
        assert allowed(combiners, "read", ROOT.pipeline_document(pipeline))
        assert not allowed(combiners, "write", ROOT.pipeline_document(pipeline))
    assert allowed(combiners, "readwrite", ROOT.pool_combiner("c-1"))
    assert allowed(combiners, "readwrite", ROOT.control("shoal-combiner-pool-1"))
    assert not allowed(combiners, "read", ROOT.ingest("plant", "gw"))
    assert not allowed(combiners, "read", ROOT.pipeline_request("admin-1"))
    assert allowed(Role.dashboard(), "read", ROOT.result_key("q", "k"))
    assert not allowed(Role.dashboard("p"), "read", ROOT.results("q"))
    assert not allowed(Role.dashboard(), "write", ROOT.results("p"))
    # What `shoal view` shows besides results: read-only, and a pipeline's own for dashboard:P.
    for topic in (ROOT.late("p"), ROOT.deadletter("p"), ROOT.pipeline_document("p")):
        assert allowed(Role.dashboard(), "read", topic)
        assert allowed(Role.dashboard("p"), "read", topic)
        assert not allowed(Role.dashboard("q"), "read", topic)
        assert not allowed(Role.dashboard(), "write", topic)
    for topic in (ROOT.metrics("worker", "w-1"), ROOT.gateway_status("gw")):
        assert allowed(Role.dashboard("q"), "read", topic)
        assert not allowed(Role.dashboard(), "write", topic)
    assert not allowed(Role.dashboard(), "read", ROOT.pipeline_request("c"))
    assert not allowed(Role.dashboard(), "read", ROOT.pipeline_reply("c"))
    assert not allowed(Role.dashboard(), "read", ROOT.confirm("gw", "p", 0))
    assert not allowed(Role.dashboard(), "read", ROOT.partials("p", 0))
    assert allowed(Role.admin(), "write", ROOT.combiner_control("p"))
    assert allowed(Role.admin(), "read", ROOT.deadletter("p"))
    assert not allowed(Role.admin(), "read", ROOT.ingest("s", "gw"))
    assert not allowed(Role.admin(), "write", ROOT.results("p"))
    # Alerts: written by their pipeline's combiners, read by dashboards and admins.
    topic = ROOT.alert("p", "hot", "k")
    assert allowed(Role.combiner("p"), "write", topic)
    assert not allowed(Role.combiner("q"), "write", topic)
    assert allowed(Role.dashboard(), "read", topic)
    assert allowed(Role.dashboard("p"), "read", topic)
    assert not allowed(Role.dashboard("q"), "read", topic)
    assert allowed(Role.admin(), "read", topic)
    assert not allowed(Role.dashboard(), "write", topic)


def test_no_root_means_top_level_topics() -> None:
    assert [r.line() for r in Role.dashboard().rules("d", Topics())] == [
        "topic read results/#",
        "topic read shoal/alerts/#",
        "topic read shoal/late/#",
        "topic read shoal/deadletter/#",
        "topic read shoal/pipelines/+",
        "topic read shoal/metrics/#",
        "topic read shoal/gateway/+",
    ]


@pytest.mark.parametrize(
    ("text", "role"),
    [
        ("gateway", Role.gateway()),
        ("gateway:a,b", Role.gateway("a", "b")),
        ("worker:p", Role.worker("p")),
        ("worker", Role.worker(None)),
        ("combiner:p", Role.combiner("p")),
        ("dashboard", Role.dashboard()),
        ("dashboard:p", Role.dashboard("p")),
        ("combiner", Role.combiner(None)),
        ("combiner:", Role.combiner(None)),
        ("admin", Role.admin()),
        ("control", Role.control()),
    ],
)
def test_parse_roles(text: str, role: Role) -> None:
    assert Role.parse(text) == role


@pytest.mark.parametrize(
    "text", ["combiner:a/b", "root", "admin:x", "control:x", "worker:a/b", "dashboard:+"]
)
def test_bad_roles_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        Role.parse(text)


def test_users_are_checked() -> None:
    with pytest.raises(ConfigError, match="user name"):
        BrokerUser("has space", "pw")
    with pytest.raises(ConfigError, match="password"):
        BrokerUser("u", "")
    with pytest.raises(ConfigError, match="gateway"):
        BrokerUser("ops@site", "pw", Role.gateway())
    assert "secret" not in repr(BrokerUser("u", "secret", Role.admin()))


def test_render_acl_has_one_block_per_user_with_a_role() -> None:
    text = render_acl([BrokerUser("gw-1", "x", Role.gateway()), BrokerUser("plain", "x")], Topics())
    assert text.count("\nuser ") + text.startswith("user ") == 1
    assert "user gw-1\ntopic write ingest/+/gw-1\n" in text
    assert "plain" not in text


def test_users_file_entries(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("from-file\nignored\n")
    users = users_from_config(
        [
            {"name": "gw-1", "role": "gateway", "password": "inline"},
            {"name": "dash", "role": "dashboard:p", "password_env": "DASH_PW"},
            {"name": "ops", "role": "admin", "password_file": "pw"},
        ],
        {"DASH_PW": "from-env"},
        tmp_path,
    )
    assert [(u.name, u.password, u.role) for u in users] == [
        ("gw-1", "inline", Role.gateway()),
        ("dash", "from-env", Role.dashboard("p")),
        ("ops", "from-file", Role.admin()),
    ]
    for bad, match in [
        ({"name": "a", "role": "admin"}, "exactly one"),
        ({"name": "a", "password": "x", "password_env": "Y"}, "exactly one"),
        ({"name": "a", "password_env": "MISSING"}, "not set"),
        ({"name": "a", "password": "x", "colour": "red"}, "unknown keys"),
        ({"role": "admin", "password": "x"}, "needs a name"),
    ]:
        with pytest.raises(ConfigError, match=match):
            users_from_config([bad], {}, tmp_path)


def test_child_env_carries_credentials_and_tls_files() -> None:
    settings = BrokerSettings(username="w", password="s3", tls=TlsSettings(ca_file=Path("/ca.crt")))
    assert settings.child_env() == {
        "SHOAL_USERNAME": "w",
        "SHOAL_PASSWORD": "s3",
        "SHOAL_TLS_CA": "/ca.crt",
    }
    assert BrokerSettings().child_env() == {}


def test_only_admin_requests_pipelines_and_only_the_control_plane_answers() -> None:
    topics = Topics("site")
    admin = [r.line() for r in Role.admin().rules("ops", topics)]
    assert "topic write site/shoal/pipelines/_request/+" in admin
    assert "topic read site/shoal/pipelines/#" in admin
    assert Role.control().rules("plane", topics) == [
        Rule("read", "site/shoal/pipelines/_request/+"),
        Rule("readwrite", "site/shoal/pipelines/+"),
        Rule("write", "site/shoal/pipelines/_reply/+"),
        Rule("readwrite", "site/shoal/control/+"),
    ]
    for role in (Role.worker("p"), Role.combiner("p"), Role.gateway("g")):
        assert not any("pipelines" in r.topic for r in role.rules("u", topics)), role
    # A dashboard reads the documents (shoal view lists the deployed pipelines), nothing else.
    dashboard = [r for r in Role.dashboard().rules("u", topics) if "pipelines" in r.topic]
    assert dashboard == [Rule("read", "site/shoal/pipelines/+")]
