"""Finding a workload's config schema (shipped or a directory) and what its errors say."""
from pathlib import Path

import pytest

import orbit_dagster.workloads as shipped
from orbit_dagster.core.config_schema import config_schema, show
from orbit_dagster.core.errors import InvalidOverride, TemplateError
from orbit_dagster.core.submission import apply_overrides
from orbit_dagster.core.templates import load_template

SCHEMA = '''
from typing import Literal
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rounds: StrictInt = Field(3, ge=1, le=10)
    mode: Literal["fast", "slow"] = "fast"
    verbose: StrictBool = False
'''


def workload(tmp_path: Path, schema: str | None = SCHEMA) -> Path:
    wl = tmp_path / "mywork"
    wl.mkdir()
    (wl / "train.py").write_text("def main(ctx):\n    pass\n")
    if schema is not None:
        (wl / "config.py").write_text(schema)
    return wl


def template_file(tmp_path: Path, wl: Path, extra: str = "") -> str:
    path = tmp_path / "mine.yaml"
    path.write_text(f"name: mine\nworkload: {wl}\neval: null\nallow_overrides: [config.rounds, config.verbose]\n{extra}")
    return str(path)


def test_a_directory_workload_brings_its_own_schema(tmp_path):
    wl = workload(tmp_path)
    t = load_template(template_file(tmp_path, wl, "config: {rounds: 5}\n"))
    assert t.config == {"rounds": 5, "mode": "fast", "verbose": False}
    with pytest.raises(InvalidOverride) as err:
        apply_overrides(t, {"config.rounds": 11})
    assert err.value.field == "config.rounds" and "<= 10" in err.value.fix
    with pytest.raises(InvalidOverride) as err:
        apply_overrides(t, {"config.verbose": 1})  # lax pydantic would take 1 for true
    assert err.value.field == "config.verbose" and "true or false" in err.value.fix
    assert not (wl / "__pycache__").exists()  # validating wrote nothing into the workload


def test_a_workload_without_a_schema_is_an_error_naming_the_fix(tmp_path):
    wl = workload(tmp_path, schema=None)
    with pytest.raises(TemplateError) as err:
        load_template(template_file(tmp_path, wl))
    assert err.value.field == "workload" and "config.py" in str(err.value) and "class Config(BaseModel)" in err.value.fix


@pytest.mark.parametrize("schema,words", [
    ("from pydantic import BaseModel\nclass Config(BaseModel):\n    x: int = 1\n", "forbid unknown keys"),
    ("CONFIG = 1\n", "no pydantic model named 'Config'"),
    ("def broken(:\n", "failed to import: SyntaxError"),
    ("import no_such_module_here\n", "failed to import: ModuleNotFoundError"),
    ("raise RuntimeError('boom')\n", "failed to import: RuntimeError: boom"),
])
def test_a_bad_schema_file_is_one_clear_error(tmp_path, schema, words):
    wl = workload(tmp_path, schema=schema)
    with pytest.raises(TemplateError) as err:
        load_template(template_file(tmp_path, wl))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_schema_is_reloaded_when_its_file_changes(tmp_path):
    wl = workload(tmp_path)
    first = config_schema(str(wl))
    assert config_schema(str(wl)) is first  # cached while unchanged
    (wl / "config.py").write_text(SCHEMA.replace("le=10", "le=20") + "\n")
    assert config_schema(str(wl)).model_fields["rounds"].metadata != first.model_fields["rounds"].metadata


def test_every_shipped_workload_declares_a_schema_that_forbids_unknown_keys():
    """Every SDK workload (a train.py defining `main(ctx)`) does; a command workload may come
    without one (its script's argparse checks its arguments), as the shipped scripts do."""
    root = Path(shipped.__file__).parent
    sdk = [d.name for d in root.iterdir() if (d / "train.py").is_file() and "def main(ctx" in (d / "train.py").read_text()]
    assert "charlm" in sdk
    for name in sdk:
        assert config_schema(name).model_config.get("extra") == "forbid"


def test_unknown_or_unreadable_workloads(tmp_path):
    with pytest.raises(TemplateError) as err:
        config_schema("no-such-workload")
    assert err.value.field == "workload"
    with pytest.raises(TemplateError) as err:
        config_schema("x" * 1000)  # longer than a file name may be
    assert err.value.field == "workload" and len(str(err.value)) < 400


def test_show_keeps_messages_short():
    assert show("abc") == "'abc'"
    long = show("y" * (1 << 20))
    assert len(long) < 100 and "1048576 characters" in long
