"""The one home of settings (orbit_dagster/settings/): every variable declared there, read there
only, documented from there, and each bad value one OrbitError naming it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.settings import Settings
from orbit_dagster.settings.__main__ import replaced
from orbit_dagster.settings.variables import HOST_VARIABLES, NAMES, Env

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "orbit_dagster"
NAME = re.compile(r"\bORBIT_[A-Z0-9_]*[A-Z0-9]\b")
# Names in examples, chosen by a user (an SSH inventory's `key_env`), not read by orbit itself.
EXAMPLES = {"ORBIT_BOX1_KEY", "ORBIT_BOX1_PASSPHRASE"}
# Where the environment may be read: the settings, and the host side, which reads its own
# (runtime/; integrations/, imported by a command workload's script on the host; the sim host
# plays a rented machine; the SSH helper runs on the rented box).
HOST_SIDE = ("orbit_dagster/settings/", "orbit_dagster/runtime/", "orbit_dagster/integrations/",
             "orbit_dagster/workloads/",  # the shipped example scripts, run on the host like a user's
             "orbit_dagster/providers/sim/host.py", "orbit_dagster/providers/ssh/host.py")


def _files(root: Path, *patterns: str) -> list[Path]:
    return [p for pattern in patterns for p in sorted(root.rglob(pattern)) if "__pycache__" not in p.parts]


def _names(paths) -> dict[str, str]:
    found: dict[str, str] = {}
    for path in paths:
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_orbit_variable_named_in_the_code_and_the_docs_is_declared_by_the_settings():
    named = _names(_files(PACKAGE, "*.py", "*.yaml") + _files(ROOT / "docs", "*.md"))
    in_code = _names(_files(PACKAGE, "*.py"))
    # The test suite's own knobs (ORBIT_SOAK_SEED, ...) are read by tests only, never by orbit.
    test_knobs = set(_names(_files(ROOT / "tests", "*.py"))) - set(in_code)
    missing = {n: where for n, where in named.items()
               if n not in NAMES and n not in HOST_VARIABLES and n not in EXAMPLES and n not in test_knobs}
    assert not missing, f"declare these in orbit_dagster/settings/variables.py (or say why not): {missing}"


def test_only_the_settings_and_the_host_side_read_the_environment():
    readers = sorted(str(p.relative_to(ROOT)) for p in _files(PACKAGE, "*.py")
                     if re.search(r"os\.environ|os\.getenv|getenv\(", p.read_text()))
    assert [r for r in readers if not r.startswith(HOST_SIDE)] == []
    assert "orbit_dagster/settings/__init__.py" in readers


def _imports(path: Path) -> set[str]:
    """Modules `path` imports, absolute (relative ones resolved against orbit_dagster)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_ledger_and_core_never_import_the_settings_or_the_control_plane():
    for layer in ("ledger", "core", "storage"):
        for path in _files(PACKAGE / layer, "*.py"):
            bad = {m for m in _imports(path) if m.startswith(("orbit_dagster.settings", "orbit_dagster.control"))}
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
    for path in _files(PACKAGE / "settings", "*.py"):  # the settings sit below control, deploy and the CLI
        bad = {m for m in _imports(path) if m.startswith(("orbit_dagster.control", "orbit_dagster.deploy",
                                                          "orbit_dagster.cli", "orbit_dagster.resources"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_docs_deploy_lists_every_setting_as_the_settings_module_declares_it():
    text = (ROOT / "docs" / "deploy.md").read_text()
    assert replaced(text) == text, "run: python -m orbit_dagster.settings --write docs/deploy.md"
    for name in NAMES:
        assert f"| `{name}` |" in text


def test_a_name_the_settings_do_not_declare_cannot_be_read():
    with pytest.raises(KeyError, match="ORBIT_NOT_A_SETTING"):
        Env({"ORBIT_NOT_A_SETTING": "1"}).get("ORBIT_NOT_A_SETTING")


@pytest.mark.parametrize("name, value, words", [
    ("ORBIT_SIM_SCALE", "fast", "positive number"),
    ("ORBIT_SIM_SCALE", "0", "positive number"),
    ("ORBIT_SIM_NOTICE_SECONDS", "-5", "number of seconds >= 0"),
    ("ORBIT_SIM_RECLAIMS", "sometimes", "trace or none"),
    ("ORBIT_EVAL_TIMEOUT_S", "soon", "positive number of seconds"),
    ("ORBIT_MIGRATION_WINDOW_S", "inf", "positive number"),
    ("ORBIT_WORKER_TIMEOUT_S", "nan", "positive number of seconds"),
    ("ORBIT_AWS_TERMINATE_GRACE_S", "-1", "positive number of seconds"),
    ("ORBIT_POOLS", "sim=many", "whole number"),
    ("ORBIT_PROFILE", "solo", "ORBIT_PROFILE=embedded"),
    ("ORBIT_CODE_SERVER", "nowhere", "HOST:PORT"),
    ("ORBIT_S3_PART_SIZE", "1024", "at least"),
    ("ORBIT_S3_MULTIPART_THRESHOLD", "lots", "e.g. ORBIT_S3_MULTIPART_THRESHOLD="),
    ("ORBIT_SQL_MEMORY", "lots", "512MiB"),
    ("ORBIT_SQL_MAX_QUERY_CHARS", "many", "65536"),
])
def test_a_bad_setting_is_one_orbit_error_naming_the_variable_the_value_and_the_fix(
        monkeypatch, tmp_path, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(OrbitError) as err:
        Settings.from_env(tmp_path)
    assert err.value.field == name and err.value.value == value and err.value.fix, err.value
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_settings_are_read_once_and_typed(monkeypatch, tmp_path):
    monkeypatch.setenv("ORBIT_SIM_SCALE", "30")
    monkeypatch.setenv("ORBIT_EVAL_TIMEOUT_S", "90")
    monkeypatch.setenv("ORBIT_TEMPLATES", str(tmp_path / "mine"))
    monkeypatch.setenv("ORBIT_CODE_SERVER", "127.0.0.1:4000")
    monkeypatch.setenv("ORBIT_S3_PART_SIZE", str(8 << 20))
    monkeypatch.setenv("ORBIT_SQL_TIMEOUT_S", "5")
    s = Settings.from_env(tmp_path)
    assert (s.sim.scale, s.eval_timeout_s, s.template_dirs) == (30.0, 90.0, [tmp_path / "mine"])
    assert (s.code_server.host, s.code_server.port) == ("127.0.0.1", 4000)
    assert s.s3_tuning()["part_size"] == 8 << 20 and s.sql_limits().timeout_s == 5.0
    monkeypatch.setenv("ORBIT_SIM_SCALE", "1")  # later changes are not seen: one snapshot
    assert s.sim.scale == 30.0 and s.with_env(ORBIT_SIM_SCALE="2").sim.scale == 2.0
    assert s.with_env(ORBIT_SIM_SCALE="2").env["ORBIT_SIM_SCALE"] == "2"  # what its processes inherit
    assert "ORBIT_SIM_SCALE" not in repr(s)  # the snapshot is not shown


def test_a_resource_s_fields_override_the_section_and_unset_fields_keep_the_environment_s(monkeypatch, tmp_path):
    monkeypatch.setenv("ORBIT_AWS_REGION", "eu-west-1")
    monkeypatch.setenv("ORBIT_AWS_ENDPOINT_URL", "http://127.0.0.1:5000")
    s = Settings.from_env(tmp_path)
    aws = s.override("aws", region="us-west-2", endpoint_url=None).aws
    assert (aws.region, aws.endpoint_url) == ("us-west-2", "http://127.0.0.1:5000")
    assert s.override("sim", reclaims="", scale=None) == s
    assert s.override(ssh_inventory="/srv/hosts.yaml").ssh_hosts == Path("/srv/hosts.yaml")
    with pytest.raises(TypeError, match="no field regoin"):
        s.override("aws", regoin="us-west-2")
    with pytest.raises(OrbitError, match="ORBIT_SIM_RECLAIMS"):  # a resource's value is checked the same way
        s.override("sim", reclaims="sometimes")


def test_the_team_profile_sets_the_ledger_and_who_follows(monkeypatch, tmp_path):
    monkeypatch.setenv("ORBIT_PROFILE", "team")
    monkeypatch.setenv("ORBIT_POSTGRES_URL", "postgresql://orbit@127.0.0.1:5432/orbit")
    monkeypatch.setenv("ORBIT_POOLS", "aws_spot=8")
    s = Settings.from_env(tmp_path)
    assert s.ledger_url == "postgresql+psycopg://orbit@127.0.0.1:5432/orbit" and s.follow == "daemon"
    assert {p.name: p.limit for p in s.profile.with_pool_defaults({"sim": 4, "ssh_rental": 6}).pools} == \
        {"sim": 4, "ssh_rental": 6, "aws_spot": 8}
