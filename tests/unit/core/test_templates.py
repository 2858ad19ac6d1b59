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


def test_a_template_in_the_search_path_given_shadows_and_core_reads_no_environment(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("name: mine\nworkload: charlm\nallow_overrides: [config.lr]\nconfig: {lr: 1}\n")
    assert load_template("mine", [tmp_path]).config["lr"] == 1
    assert "mine" in list_templates([tmp_path])
    monkeypatch.setenv("ORBIT_TEMPLATES", str(tmp_path))  # the settings' to read, not core's
    assert "mine" not in list_templates()


def test_template_whitelist_must_name_real_fields():
    with pytest.raises(TemplateError) as err:
        parse_template("name: x\nworkload: charlm\nallow_overrides: [config.nothing]\n", source="x")
    assert "config.nothing" in str(err.value)


def test_template_rejects_unknown_fields():
    with pytest.raises(TemplateError) as err:
        parse_template("name: x\nworkload: charlm\nmystery: 1\n", source="x")
    assert "mystery" in str(err.value)


# ---- typed templates: the config schema, strict types, new fields ----------------------------

ISSUE_CASES = [  # (override, field, words of the fix), as filed against the untyped templates
    ("config.lr=abc", "config.lr", "number > 0"),
    ("config.dropout=2", "config.dropout", "< 1"),
    ("config.steps=-5", "config.steps", ">= 1"),
    ("config.steps=0", "config.steps", ">= 1"),
    ("config.trainable=banana", "config.trainable", "'all', 'head'"),
    ("checkpoint.every_steps=true", "checkpoint.every_steps", "integer >= 1"),
    ("config.lr=.inf", "config.lr", "number > 0"),
    ("config.seed=1.5", "config.seed", "integer"),
    ("config.micro_batch=true", "config.micro_batch", "integer"),
    ("placement=local", "placement", "'sim', 'ssh_rental', 'aws_spot'"),
    ("checkpoint.interval_policy=sometimes", "checkpoint.interval_policy", "'orbit', 'fixed', 'young-daly'"),
    ("checkpoint.on_rebalance=move", "checkpoint.on_rebalance", "'checkpoint', 'record', 'migrate'"),
    ("deadline_hours=0", "deadline_hours", "> 0"),
    ("deadline_hours=-3", "deadline_hours", "> 0"),
    ("max_price_per_gpu_hour=free", "max_price_per_gpu_hour", "number > 0"),
]


@pytest.mark.parametrize("pair,field,fix", ISSUE_CASES)
def test_invalid_override_values_are_refused_naming_field_value_and_fix(pair, field, fix):
    t = load_template("charlm-finetune")
    with pytest.raises(InvalidOverride) as err:
        apply_overrides(t, parse_set_args([pair]))
    e = err.value
    assert e.field == field and e.fix and fix in e.fix, str(e)
    assert field in str(e) and pair.split("=", 1)[1].lstrip(".") in str(e).replace("True", "true")
    assert "\n" not in str(e)


def test_valid_overrides_keep_their_types():
    t = apply_overrides(load_template("charlm-finetune"), parse_set_args(
        ["config.lr=1e-3", "config.dropout=0", "deadline_hours=12", "checkpoint.interval_policy=young-daly",
         "config.trainable=head", "config.device_memory_mb=16"]))
    assert t.config["lr"] == 0.001 and isinstance(t.config["dropout"], float) and t.deadline_hours == 12.0
    assert t.checkpoint.interval_policy == "young-daly" and t.config["trainable"] == "head"


def test_shipped_template_defaults_orbit_interval_no_deadline_and_complete_config():
    t = load_template("charlm-finetune")
    assert t.checkpoint.interval_policy == "orbit" and t.deadline_hours is None
    # Keys the YAML leaves out come from the workload's schema, so the bundle lists them all.
    assert t.config["eval_seed"] == 12345 and t.config["corpus"] == "corpus.txt"
    assert set(t.resume_compatible) == {"config.steps", "config.micro_batch", "config.grad_accum"}


def test_template_config_is_checked_against_the_schema():
    with pytest.raises(TemplateError) as err:
        parse_template("name: x\nworkload: charlm\nconfig: {lrr: 0.1}\n", source="x.yaml")
    assert err.value.field == "config.lrr" and "steps" in err.value.fix and "lr" in err.value.fix
    with pytest.raises(TemplateError) as err:
        parse_template("name: x\nworkload: charlm\nconfig: {steps: 1e3}\n", source="x.yaml")  # YAML: a string
    assert err.value.field == "config.steps" and "integer" in err.value.fix
    with pytest.raises(TemplateError) as err:
        parse_template("name: x\nworkload: charlm\nconfig: {d_model: 100, n_heads: 3}\n", source="x.yaml")
    assert err.value.field == "config.n_heads" and "divide d_model" in str(err.value)
    with pytest.raises(TemplateError) as err:
        parse_template("name: x\nworkload: charlm\nconfig: [1, 2]\n", source="x.yaml")
    assert err.value.field == "config"


@pytest.mark.parametrize("yaml_line,field", [
    ("resume_compatible: [placement]", "resume_compatible"),
    ("resume_compatible: [config.nope]", "resume_compatible"),
    ("deadline_hours: 0", "deadline_hours"),
    ("deadline_hours: .inf", "deadline_hours"),
    ("entrypoint: ../../etc/passwd", "entrypoint"),
    ("inputs: [../secret.txt]", "inputs.0"),
    ("env: {'BAD NAME': x}", "env.BAD NAME.[key]"),
    ("version: true", "version"),
    ("resources: {gpu_count: 1.5}", "resources.gpu_count"),
])
def test_template_fields_are_typed_and_bounded(yaml_line, field):
    with pytest.raises(TemplateError) as err:
        parse_template(f"name: x\nworkload: charlm\n{yaml_line}\n", source="x.yaml")
    assert err.value.field == field, str(err.value)


def test_lineage_hash_ignores_only_the_resume_compatible_keys():
    t = load_template("charlm-finetune")
    same = [{"config.steps": 1000}, {"config.micro_batch": 8, "config.grad_accum": 4}, {"placement": "ssh_rental"},
            {"checkpoint.every_steps": 7}, {"deadline_hours": 3}]
    for change in same:
        assert apply_overrides(t, change).lineage_hash() == t.lineage_hash(), change
    for change in ({"config.lr": 0.01}, {"config.seed": 1}, {"config.dropout": 0.0}, {"config.trainable": "head"}):
        assert apply_overrides(t, change).lineage_hash() != t.lineage_hash(), change
    assert t.model_copy(update={"entrypoint": "other.py"}).lineage_hash() != t.lineage_hash()
    assert t.model_copy(update={"workload": "elsewhere"}).lineage_hash() != t.lineage_hash()


def test_lineage_hash_is_the_sha256_of_the_canonical_json():
    import hashlib
    import json

    t = load_template("charlm-finetune")
    config = {k: v for k, v in t.config.items() if k not in ("steps", "micro_batch", "grad_accum")}
    text = json.dumps({"workload": "charlm", "entrypoint": "train.py", "config": config}, sort_keys=True,
                      separators=(",", ":"))
    assert t.lineage_hash() == hashlib.sha256(text.encode()).hexdigest()
    # Key order and int-vs-float spelling in the YAML do not change it: the schema normalises both.
    reordered = parse_template("name: y\nworkload: charlm\nresume_compatible: [config.steps]\n"
                               "config: {lr: 0.003, steps: 5, dropout: 0.1}\n", source="y")
    spelled = parse_template("name: y\nworkload: charlm\nresume_compatible: [config.steps]\n"
                             "config: {steps: 9, dropout: 0.1, lr: 3.0e-3}\n", source="y")
    assert reordered.lineage_hash() == spelled.lineage_hash()


def test_big_template_files_are_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("name: big\nworkload: charlm\ndescription: '" + "x" * (1 << 20) + "'\n")
    with pytest.raises(TemplateError) as err:
        load_template(str(big))
    assert err.value.field == "template" and len(str(err.value)) < 500
