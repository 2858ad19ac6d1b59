"""`--set` parsing and the bounds on what a person may submit: one clear error each."""
import math

import pytest

from orbit_dagster.core.errors import InvalidOverride, OrbitError, OverrideNotAllowed
from orbit_dagster.core.submission import (
    MAX_OVERRIDES,
    MAX_VALUE_CHARS,
    apply_overrides,
    check_job_id,
    check_name,
    check_overrides,
    check_template_ref,
    parse_set_args,
    parse_value,
)
from orbit_dagster.core.templates import load_template

MIB = "x" * (1 << 20)


@pytest.mark.parametrize("raw,value", [
    ("1e-3", 0.001), ("3.0e-3", 0.003), ("-5", -5), ("010", 10), ("+7", 7), ("0.5", 0.5), (".5", 0.5),
    ("true", True), ("False", False), ("null", None), ("~", None), ("", ""), ("abc", "abc"),
    ("'123'", "123"), ('"true"', "true"), ("1:30", "1:30"), ("[1, 2]", "[1, 2]"), ("{a: 1}", "{a: 1}"),
    ("2024-01-01", "2024-01-01"), ("&a [*a]", "&a [*a]"), ("!!python/object/apply:os.system ['id']",
                                                          "!!python/object/apply:os.system ['id']"),
    ("0x10", "0x10"), ("1_000", "1_000"), ("none", "none"), (" head ", "head"),
])
def test_values_are_plain_scalars_not_yaml(raw, value):
    got = parse_value(raw)
    assert got == value and type(got) is type(value)


def test_special_floats_parse_as_floats_for_the_schema_to_refuse():
    assert parse_value(".inf") == math.inf and math.isnan(parse_value("nan"))


def test_set_args_bounds():
    with pytest.raises(InvalidOverride) as err:
        parse_set_args([f"config.lr={MIB}"])
    assert err.value.field == "config.lr" and str(MAX_VALUE_CHARS) in str(err.value) and len(str(err.value)) < 300
    with pytest.raises(InvalidOverride) as err:
        parse_set_args(["config.lr=0.1"] * (MAX_OVERRIDES + 1))
    assert "at most" in str(err.value)
    with pytest.raises(InvalidOverride) as err:
        parse_set_args(["config.lr=0.1", "config.lr=0.2"])
    assert "twice" in str(err.value) and err.value.field == "config.lr"
    for bad in ("config..lr=1", ".lr=1", "config.lr x=1", "a" * 200 + "=1", "conf\nig=1", "=1", "novalue"):
        with pytest.raises(InvalidOverride) as err:
            parse_set_args([bad])
        assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_check_overrides_takes_scalars_only_and_bounds_strings():
    assert check_overrides({"config.lr": 0.1, "region": None, "config.trainable": "head"})
    for bad in ({"config.lr": [1, 2]}, {"config.lr": {"a": 1}}, {"config.lr": MIB}, {1: 2}, {"a b": 1}):
        with pytest.raises(InvalidOverride):
            check_overrides(bad)
    with pytest.raises(InvalidOverride):
        check_overrides(["config.lr=1"])


def test_a_one_mib_string_is_refused_with_a_short_message_even_where_no_limit_applies_first():
    t = load_template("charlm-finetune")
    with pytest.raises(InvalidOverride) as err:
        apply_overrides(t, {"config.trainable": MIB})
    assert len(str(err.value)) < 400 and "1048576 characters" in str(err.value)
    with pytest.raises(OverrideNotAllowed) as err:
        apply_overrides(t, {MIB: 1})
    assert len(str(err.value)) < 2000


@pytest.mark.parametrize("field", ["experiment", "project"])
@pytest.mark.parametrize("value", ["", "a b", "x" * 64, "-x", "../up", "é", "a/b", "a\nb", MIB, None, 7])
def test_bad_names_are_orbit_errors_naming_the_field(field, value):
    with pytest.raises(OrbitError) as err:
        check_name(field, value)
    assert err.value.field == field and "letters, digits" in err.value.fix and len(str(err.value)) < 300


def test_good_names_template_refs_and_job_ids_pass():
    assert check_name("experiment", "exp-1.a_b") and check_name("project", "x" * 63)
    assert check_template_ref("charlm-finetune") and check_template_ref("my/own.yaml")
    assert check_job_id("charlm-finetune-1a2b3c4d")


@pytest.mark.parametrize("value", ["", "Charlm", "../../etc/passwd", "a" * 64, MIB, "x.yaml\0"])
def test_bad_template_refs(value):
    with pytest.raises(OrbitError) as err:
        check_template_ref(value)
    assert err.value.field == "template" and len(str(err.value)) < 400


@pytest.mark.parametrize("value", ["", "a b", "-x", MIB, "x" * 129, "job;rm"])
def test_bad_job_ids(value):
    with pytest.raises(OrbitError) as err:
        check_job_id(value)
    assert err.value.field == "job"
