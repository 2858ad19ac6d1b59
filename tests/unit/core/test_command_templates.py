"""Templates of command workloads: the argv, its placeholders, the stop signal, the watcher's fields."""
import pytest

from orbit_dagster.core.errors import TemplateError
from orbit_dagster.core.submission import apply_overrides
from orbit_dagster.core.templates import load_template, typed_template


def template(tmp_path, **fields):
    (tmp_path / "train.py").write_text("print('hi')\n")
    raw = {"name": "cmd", "workload": str(tmp_path), "command": ["python", "train.py", "--out", "{checkpoint_dir}"],
           "config": {"steps": 10, "lr": 0.1}, **fields}
    return typed_template({k: v for k, v in raw.items() if v is not ...}, context="template cmd")


def refused(tmp_path, **fields) -> TemplateError:
    with pytest.raises(TemplateError) as err:
        template(tmp_path, **fields)
    return err.value


def test_a_command_workload_needs_no_config_schema_and_has_no_sdk_entrypoint(tmp_path):
    t = template(tmp_path)
    assert t.command == ("python", "train.py", "--out", "{checkpoint_dir}") and t.entrypoint is None
    assert t.config == {"steps": 10, "lr": 0.1} and t.stop_signal == "SIGTERM" and t.eval is None
    assert t.checkpoint.settle_seconds == 2.0 and t.checkpoint.pattern is None and t.checkpoint.complete_marker is None


def test_the_shipped_plain_script_template_loads_and_its_overrides_apply():
    t = load_template("plain-script")
    assert t.command[0] == "python" and t.eval.command[-1] == "{checkpoint_path}"
    assert apply_overrides(t, {"config.steps": 20}).config["steps"] == 20


def test_placeholders_known_and_of_config_keys_are_accepted(tmp_path):
    argv = ["python", "train.py", "{resume_from}", "{metrics_file}", "{job_id}", "{attempt}", "{checkpoint_every}",
            "--steps={config.steps}", "{{literal}}"]
    assert template(tmp_path, command=argv).command == tuple(argv)


@pytest.mark.parametrize("element, says", [
    ("{output}", "unknown placeholder {output}"),
    ("{config.nope}", "names no key of config"),
    ("{checkpoint_path}", "unknown placeholder {checkpoint_path}"),  # eval only
    ("{checkpoint_dir!r}", "conversion or format spec"),
    ("{checkpoint_dir", "literal brace"),
])
def test_an_unknown_placeholder_is_refused_naming_the_element_and_the_fix(tmp_path, element, says):
    err = refused(tmp_path, command=["python", "train.py", element])
    assert err.field == "command[2]" and says in str(err) and "fix:" in str(err)


def test_eval_command_placeholders_are_checked_and_may_name_the_checkpoint(tmp_path):
    ok = template(tmp_path, eval={"command": ["python", "eval.py", "{checkpoint_path}"]})
    assert ok.eval.command[-1] == "{checkpoint_path}" and ok.eval.entrypoint is None
    assert refused(tmp_path, eval={"command": ["python", "{ckpt}"]}).field == "eval.command[1]"


def test_a_command_template_with_an_sdk_eval_is_refused(tmp_path):
    err = refused(tmp_path, eval={"entrypoint": "eval.py"})
    assert err.field == "eval" and "eval.command" in str(err)


def test_command_and_entrypoint_together_are_refused(tmp_path):
    err = refused(tmp_path, entrypoint="train.py")
    assert err.field == "command" and "entrypoint" in str(err)


@pytest.mark.parametrize("command, field", [
    ([], "command"),
    (["python", 5], "command.1"),
    (["python"] * 257, "command"),
    (["x" * 5000], "command.0"),
    ("python train.py", "command"),  # a shell string: an argv is a list
])
def test_bad_argv_is_refused_naming_the_field(tmp_path, command, field):
    assert refused(tmp_path, command=command).field == field


def test_a_nul_byte_in_the_argv_is_refused(tmp_path):
    err = refused(tmp_path, command=["python", "train.py\0"])
    assert err.field == "command.1" and "NUL" in str(err)


def test_an_unknown_or_uncatchable_stop_signal_is_refused(tmp_path):
    assert template(tmp_path, stop_signal="SIGINT").stop_signal == "SIGINT"
    for name in ("SIGNOPE", "SIGKILL", "TERM"):
        err = refused(tmp_path, stop_signal=name)
        assert err.field == "stop_signal" and "signal" in str(err)


def test_a_bad_checkpoint_pattern_is_refused_naming_the_field(tmp_path):
    good = template(tmp_path, checkpoint={"pattern": r"^ckpt_(?P<step>\d+)\.pt$", "complete_marker": ".orbit-complete"})
    assert good.checkpoint.complete_marker == ".orbit-complete"
    bad = refused(tmp_path, checkpoint={"pattern": "ckpt_(\\d+"})
    assert bad.field == "checkpoint.pattern" and "regular expression" in str(bad)
    no_step = refused(tmp_path, checkpoint={"pattern": r"ckpt_(\d+)"})
    assert no_step.field == "checkpoint.pattern" and "step" in str(no_step)
    for marker in ("..", "a/b"):
        assert refused(tmp_path, checkpoint={"complete_marker": marker}).field == "checkpoint.complete_marker"
    assert refused(tmp_path, checkpoint={"settle_seconds": -1}).field == "checkpoint.settle_seconds"


def test_config_without_a_schema_must_be_plain_data(tmp_path):
    assert template(tmp_path, config={"a": [1, {"b": None}], "c": "x", "d": True}).config["a"] == [1, {"b": None}]
    err = refused(tmp_path, config={"lr": float("nan")})
    assert err.field == "config.lr"
    err = refused(tmp_path, config={1: 2})
    assert err.field == "config"
    assert refused(tmp_path, config=[1, 2]).field == "config"


def test_the_lineage_covers_the_command_but_an_sdk_templates_is_unchanged(tmp_path):
    a = template(tmp_path)
    b = template(tmp_path, command=["python", "train.py", "--out", "{checkpoint_dir}", "--fast"])
    assert a.lineage_hash() != b.lineage_hash()
    # The SDK example's lineage hash as it was before command workloads existed.
    assert load_template("charlm-finetune").lineage_hash()[:12] == "b30aa469d466"
