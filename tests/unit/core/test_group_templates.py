"""Templates of jobs that span several instances: `resources.nodes` and `elastic`, each refusal
one line naming the field, the value and the fix (docs/multi-node.md)."""
from __future__ import annotations

import pytest

from orbit_dagster.core.errors import InvalidOverride, TemplateError
from orbit_dagster.core.execution import Resources
from orbit_dagster.core.submission import apply_overrides
from orbit_dagster.core.templates import load_template, typed_template


def raw(name: str = "fsdp-multinode", **resources) -> dict:
    doc = load_template(name).model_dump(mode="json")
    doc["resources"].update(resources)
    return doc


def refusal(doc: dict) -> TemplateError:
    with pytest.raises(TemplateError) as err:
        typed_template(doc, context="template t")
    assert "\n" not in str(err.value) and "; fix: " in str(err.value)
    return err.value


def test_one_node_is_the_default_and_a_group_is_a_field():
    assert Resources().nodes == 1 and load_template("fsdp-script").resources.nodes == 1
    assert load_template("fsdp-script").elastic is None
    t = load_template("fsdp-multinode")
    assert (t.resources.nodes, t.elastic.min_nodes, t.elastic.max_nodes) == (2, 1, 2)
    assert typed_template(raw(nodes=3) | {"elastic": {"min_nodes": 2, "max_nodes": 4}},
                          context="t").resources.nodes == 3


def test_an_sdk_entrypoint_asking_for_nodes_is_refused_like_processes():
    err = refusal(raw("charlm-finetune", nodes=2))
    assert (err.field, err.value) == ("resources.nodes", 2)
    assert "SDK entrypoint" in str(err) and "resources.nodes: 1" in err.fix
    doc = raw(nodes=2) | {"kind": "collect"}
    err = refusal(doc | {"elastic": None})
    assert err.field == "resources.nodes" and "kind: train" in err.fix


@pytest.mark.parametrize("nodes, elastic", [(2, {"min_nodes": 3, "max_nodes": 4}), (3, {"min_nodes": 1, "max_nodes": 2}),
                                            (1, {"min_nodes": 2, "max_nodes": 2})])
def test_elastic_must_hold_the_node_count(nodes, elastic):
    err = refusal(raw(nodes=nodes) | {"elastic": elastic})
    assert err.field == "elastic" and err.value == elastic
    assert f"{elastic['min_nodes']} <= {nodes} <= {elastic['max_nodes']} does not hold" in str(err)
    assert f"at most {nodes}" in err.fix and f"at least {nodes}" in err.fix


@pytest.mark.parametrize("change, field, words", [
    ({"resources": {"nodes": 0}}, "resources.nodes", "integer >= 1 and <= 64"),
    ({"resources": {"nodes": 65}}, "resources.nodes", "integer >= 1 and <= 64"),
    ({"resources": {"nodes": True}}, "resources.nodes", "integer"),
    ({"elastic": {"min_nodes": 0, "max_nodes": 2}}, "elastic.min_nodes", "elastic.min_nodes takes an integer"),
    ({"elastic": {"min_nodes": 1}}, "elastic.max_nodes", "elastic.max_nodes is required"),
    ({"elastic": {"min_nodes": 1, "max_nodes": 2, "grow": 1}}, "elastic.grow", "min_nodes, max_nodes"),
])
def test_each_bad_value_is_named_with_its_fix(change, field, words):
    doc = raw()
    for key, value in change.items():
        doc[key] = {**doc[key], **value} if key == "resources" else value
    err = refusal(doc)
    assert err.field == field and words in err.fix


def test_an_override_of_the_node_count_is_checked_against_elastic():
    t = load_template("fsdp-multinode")
    assert apply_overrides(t, {"resources.nodes": 1}).resources.nodes == 1
    assert apply_overrides(t, {"elastic.min_nodes": 2}).elastic.min_nodes == 2
    with pytest.raises((InvalidOverride, TemplateError)) as err:
        apply_overrides(t, {"resources.nodes": 3})  # max_nodes is 2
    assert err.value.field == "elastic" and "3 <= 2" not in err.value.fix


def test_elastic_set_to_null_keeps_its_fields_in_the_whitelist_and_refuses_a_field_inside_it():
    t = load_template("fsdp-multinode")
    off = apply_overrides(t, {"elastic": None})  # never shrink: a reclaimed node is always replaced
    assert off.elastic is None and "elastic.min_nodes" in off.allow_overrides
    with pytest.raises(InvalidOverride) as err:
        apply_overrides(t, {"elastic": None, "elastic.min_nodes": 2})
    assert "which is null here" in str(err.value) and "\n" not in str(err.value)
    doc = raw() | {"allow_overrides": ["config.steps", "elastic.min_nodes"], "elastic": None}
    err = refusal(doc)  # a field under a null section that is not itself overridable: still a typo
    assert "elastic.min_nodes" in str(err)
