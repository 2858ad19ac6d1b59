import pytest

from orbit_dagster.core.errors import InvalidOverride, OverrideNotAllowed, TemplateError
from orbit_dagster.core.submission import apply_overrides, execution_request_for, parse_set_args
from orbit_dagster.core.templates import list_templates, load_template, parse_template


def test_shipped_template_loads_and_has_a_whitelist():
    t = load_template("charlm-finetune")
    assert t.kind == "train" and t.workload == "charlm"
    assert "config.lr" in t.allow_overrides
    assert "charlm-finetune" in list_templates()


def test_override_outside_whitelist_names_field_and_allowed_list():
    t = load_template("charlm-finetune")
    with pytest.raises(OverrideNotAllowed) as err:
        apply_overrides(t, {"config.d_model": 512})
    msg = str(err.value)
    assert "config.d_model" in msg and "config.lr" in msg and "allowed" in msg
    assert err.value.field == "config.d_model"


def test_override_is_applied_and_typed():
    t = load_template("charlm-finetune")
    out = apply_overrides(t, parse_set_args(["config.lr=0.001", "placement=ssh_rental", "config.steps=10"]))
    assert out.config["lr"] == 0.001 and out.config["steps"] == 10 and out.placement == "ssh_rental"
    assert t.config["lr"] == 0.003  # the template itself is untouched
    assert execution_request_for(out).backend_key == "ssh_rental_host_process"


def test_override_with_bad_value_names_field():
    t = load_template("charlm-finetune")
    with pytest.raises(InvalidOverride) as err:
        apply_overrides(t, {"placement": "moon"})
    assert "placement" in str(err.value)


def test_set_args_must_be_key_value():
    with pytest.raises(InvalidOverride):
        parse_set_args(["config.lr"])


def test_unknown_template_lists_known_ones():
    with pytest.raises(TemplateError) as err:
        load_template("nope")
    assert "charlm-finetune" in str(err.value)


def test_user_template_dir_shadows(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("name: mine\nworkload: charlm\nallow_overrides: [config.lr]\nconfig: {lr: 1}\n")
    monkeypatch.setenv("ORBIT_TEMPLATES", str(tmp_path))
    assert load_template("mine").config["lr"] == 1


def test_template_whitelist_must_name_real_fields():
    with pytest.raises(TemplateError) as err:
        parse_template("name: x\nworkload: charlm\nallow_overrides: [config.nothing]\n", source="x")
    assert "config.nothing" in str(err.value)


def test_template_rejects_unknown_fields():
    with pytest.raises(TemplateError) as err:
        parse_template("name: x\nworkload: charlm\nmystery: 1\n", source="x")
    assert "mystery" in str(err.value)
