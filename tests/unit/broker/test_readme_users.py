"""The README's users.toml example is a users file shoal reads, plain ``password`` included."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from shoal.broker.access import users_from_config

README = (Path(__file__).resolve().parents[3] / "README.md").read_text("utf-8")


def test_the_readme_users_file_reads_with_all_three_password_forms(tmp_path: Path) -> None:
    block = re.search(r"```toml\n# users.toml\n(.*?)```", README, re.S)
    assert block is not None
    entries = tomllib.loads(block.group(1))["users"]
    assert {"password", "password_env", "password_file"} <= {k for e in entries for k in e}
    (tmp_path / "grafana.pw").write_text("from-a-file\n")
    env = {"GW7_PASSWORD": "from-env", "WORKER_PASSWORD": "workers"}
    users = {u.name: u.password for u in users_from_config(entries, env, tmp_path)}
    assert users["gw-1"] == "change-me"
    assert users["gw-7"] == "from-env"
    assert users["grafana"] == "from-a-file"
