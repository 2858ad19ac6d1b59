"""The host contract: every kind round-trips; refusals name the kind, version or field; torn lines wait."""
from __future__ import annotations

import ast
import json
import math
from dataclasses import fields
from pathlib import Path

import pytest

from orbit_dagster.core import host_contract as H

CORE = Path(H.__file__).parent

SAMPLES: dict[str, H.HostEvent] = {e.KIND: e for e in (
    H.Started(task="train", attempt=2, pid=4242, precheck={"python": "3.11.7", "devices": [], "cuda_available": False}),
    H.Device(device="cpu", device_name="x86_64", precision="fp32"),
    H.Probe(tflops=0.21, dtype="float32", device="cpu", device_name="x86_64", size=512, iterations=40, seconds=0.5,
            threads=1, torch="2.5.1"),
    H.Resumed(uri="file:///s/job-a/step-000000004-a1", step=4, tier="durable"),
    H.Loaded(uri="file:///s/job-a/step-000000004-a1", step=4, tier="emergency"),
    H.Metrics(step=7, values={"train/loss": 2.5, "lr": 1e-3}),
    H.Progress(step=8),
    H.Checkpoint(step=8, tier="emergency", uri="file:///s/job-a/step-000000008-a2", sha256="a" * 64, bytes=1234,
                 attempt=2, weights_sha256="b" * 64, parent="file:///s/job-a/step-000000004-a1", train_loss=2.4,
                 save_seconds=0.01, blocked_seconds=0.01, write_seconds=0.005, source="metadata",
                 changed_fraction=0.25, changed_measure="bytes", delta_of="file:///s/job-a/step-000000004-a1",
                 plan="delta", plan_fits=True, plan_reason="a delta of 1.2 MB fits", estimate_s=0.4,
                 time_left_s=28.5),
    H.LocalCheckpoint(step=8, attempt=2, uri="file:///host/local-checkpoints/job-a/step-000000008-a2",
                      sha256="c" * 64, bytes=1234, seconds=0.2, time_left_s=4.5),
    H.Interval(step=8, next_step=20, steps=12, age_s=960.0, policy="orbit", reason="the policy's interval",
               cadence_steps=50, interval_s=57.6, policy_steps=12, work_left_s=1000.0, step_s=4.8),
    H.Notice(source="metadata", deadline=1_790_000_030.0, received_at=1_790_000_000.5, step=8, plan="full",
             plan_fits=False, plan_reason="estimated 45.0 s, 29.5 s left: expected to miss", estimate_s=45.0,
             time_left_s=29.5),
    H.Rebalance(source="metadata", notice_time=1_790_000_000.0, received_at=1_790_000_000.5, action="checkpoint"),
    H.Evaluation(metrics={"eval/loss": 1.9}, checkpoint="file:///s/job-a/step-000000008-a2"),
    H.Exit(code=75, failure_class="reclaim", reason="reclaim notice", seconds=12.5, last_step=8),
)}


def lines(*records: H.HostEvent) -> bytes:
    return "".join(H.encode(H.stamp(r, seq=i + 1, ts=1_790_000_000.0 + i)) for i, r in enumerate(records)).encode()


def refusal(line: str) -> H.Rejected:
    (got,), _ = H.read_chunk(line.encode() + b"\n", 0)
    assert isinstance(got, H.Rejected), got
    return got


def test_every_kind_the_host_writes_has_a_sample_here():
    assert set(SAMPLES) == set(H.KINDS)


@pytest.mark.parametrize("kind", sorted(H.KINDS))
def test_every_kind_round_trips_through_a_line(kind):
    record = H.stamp(SAMPLES[kind], seq=3, ts=1_790_000_000.25)
    line = H.encode(record)
    assert line.endswith("\n") and "\n" not in line[:-1]
    obj = json.loads(line)
    assert obj["type"] == kind and obj["contract"] == H.version_of(record)  # its kind's and fields' own version
    (back,), offset = H.read_chunk(line.encode(), 100)
    assert back == record and type(back) is type(record) and offset == 100 + len(line.encode())


def test_a_diverged_metric_is_written_as_valid_json_and_read_back_as_nan():
    line = H.encode(H.Metrics(step=3, values={"train/loss": math.nan, "g": math.inf}))
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in a line"))["values"] == {
        "train/loss": "nan", "g": "inf"}
    (back,), _ = H.read_chunk(line.encode(), 0)
    assert math.isnan(back.values["train/loss"]) and back.values["g"] == math.inf


def test_a_notice_or_checkpoint_of_a_host_before_emergency_plans_still_reads():
    """The plan fields came later: lines without them (an older host) read with them absent."""
    old = b'{"type": "notice", "seq": 1, "ts": 1.0, "source": "sigterm", "deadline": null, "received_at": 1.0}\n'
    (got,), _ = H.read_chunk(old, 0)
    assert isinstance(got, H.Notice) and got.plan is None and got.plan_fits is None


def test_a_line_without_a_version_is_read_as_version_1():
    """What a host started by the previous version wrote (the same kinds and fields, no `contract`)."""
    old = (b'{"seq": 4, "ts": 1790000000.5, "type": "metrics", "step": 10, "values": {"train/loss": 2.0}}\n'
           b'{"attempt": 1, "blocked_seconds": 0.01, "bytes": 99, "parent": null, "save_seconds": 0.02, "seq": 5, '
           b'"sha256": "ab", "source": null, "step": 10, "tier": "durable", "train_loss": 2.0, "ts": 1790000000.6, '
           b'"type": "checkpoint", "uri": "file:///s/j/step-000000010-a1", "weights_sha256": "cd", '
           b'"write_seconds": 0.01}\n')
    (metrics, ckpt), offset = H.read_chunk(old, 0)
    assert metrics == H.Metrics(seq=4, ts=1790000000.5, contract=1, step=10, values={"train/loss": 2.0})
    assert isinstance(ckpt, H.Checkpoint) and ckpt.contract == 1 and ckpt.bytes == 99 and offset == len(old)


@pytest.mark.parametrize("line, words", [
    ('{"type": "metrics", "step": 1, "values": {}, "contract": 4}', "metrics: contract version 4 is not one"),
    ('{"type": "rebalance", "source": "metadata", "notice_time": null, "received_at": 1, "action": "record", '
     '"contract": 1}', "rebalance: a kind of contract version 2; the line says version 1"),
    ('{"type": "rebalance", "source": "metadata", "notice_time": null, "received_at": 1, "action": "record"}',
     "rebalance: a kind of contract version 2; the line says version 1"),
    ('{"type": "metrics", "step": 1, "values": {}, "contract": "1"}', "contract version '1'"),
    ('{"type": "metrics", "step": 1, "values": {}, "contract": true}', "contract version True"),
    ('{"type": "heartbeat", "step": 1}', "unknown kind 'heartbeat'"),
    ('{"step": 1}', "unknown kind None"),
    ('{"type": 3}', "unknown kind 3"),
    ('{"type": "progress"}', "progress: field 'step' is missing"),
    ('{"type": "progress", "step": "7"}', "progress: field 'step' is '7', not an integer"),
    ('{"type": "progress", "step": true}', "field 'step' is True, not an integer"),
    ('{"type": "progress", "step": -1}', "field 'step' is -1, not an integer in [0, "),
    (f'{{"type": "progress", "step": {2**62 + 1}}}', "not an integer in [0, 4611686018427387904]"),
    ('{"type": "progress", "step": 1, "values": {}}', "progress: unknown field(s) 'values'"),
    ('{"type": "metrics", "step": 1, "values": [1.0]}', "metrics: field 'values' is [1.0], not a mapping"),
    ('{"type": "metrics", "step": 1, "values": {"loss": "low"}}', "field \"values['loss']\" is 'low', not a number"),
    ('{"type": "metrics", "step": 1, "values": {"loss": 1e400000}}', None),  # inf: read, never stored (control)
    (f'{{"type": "metrics", "step": 1, "values": {{"loss": {10**400}}}}}', "not a number a float holds"),
    ('{"type": "exit", "code": 0, "failure_class": 7, "reason": "", "seconds": 1}', "exit: field 'failure_class'"),
    ('[1, 2]', "a line is a JSON object, not list"),
    ('{"type": "notice", "source": "x", "deadline": null, "received_at": 1, "contract": 2, "plan_fits": "no"}',
     "notice: field 'plan_fits' is 'no', not true or false"),
    ('{"type": "notice", "source": "x", "deadline": null, "received_at": 1, "contract": 2, "plan_fits": 1}',
     "field 'plan_fits' is 1, not true or false"),
])
def test_refusals_name_the_kind_version_or_field(line, words):
    if words is None:
        (got,), _ = H.read_chunk(line.encode() + b"\n", 0)
        assert isinstance(got, H.Metrics) and got.values["loss"] == math.inf
        return
    got = refusal(line)
    assert words in got.reason, got.reason
    assert got.line == line


def test_garbage_nul_bytes_deep_nesting_and_bad_utf8_are_refused_not_raised():
    chunk = b"not json\n\x00\x01\n" + b"[" * 100000 + b"]" * 100000 + b"\n" + b'{"type": "progress", "step": 1\xff}\n'
    got, offset = H.read_chunk(chunk, 0)
    assert [g.reason for g in got] == ["not a JSON line (JSONDecodeError)"] * 2 + [
        "not a JSON line (RecursionError)", "not UTF-8 text"]
    assert offset == len(chunk) and len(got[2].line) == H.SHOWN_CHARS


def test_a_torn_last_line_waits_and_offsets_are_bytes_of_the_file(tmp_path):
    path = tmp_path / H.EVENTS_FILE
    whole = lines(H.Progress(step=1), H.Metrics(step=2, values={"é": 1.0}))
    torn = lines(H.Checkpoint(step=4, tier="durable", uri="file:///x", sha256="ab", bytes=3, attempt=1))
    path.write_bytes(whole + b"garbage\n" + torn[:25])
    got, offset = H.read_file(path, 0)
    assert [type(g) for g in got] == [H.Progress, H.Metrics, H.Rejected]
    assert got[2].offset == len(whole) and offset == len(whole) + len(b"garbage\n")
    assert H.read_file(path, offset) == ([], offset)  # still torn: nothing, the offset stays
    with open(path, "ab") as fh:
        fh.write(torn[25:])
    (ckpt,), end = H.read_file(path, offset)
    assert isinstance(ckpt, H.Checkpoint) and ckpt.step == 4 and end == path.stat().st_size
    assert H.read_file(tmp_path / "none.jsonl", 7) == ([], 7)


def test_a_line_longer_than_a_read_is_refused_and_skipped():
    got, offset = H.read_chunk(b"x" * 64, 10, limit=64)
    assert offset == 74 and got[0].reason == "a line longer than 64 bytes"
    assert H.read_chunk(b"x" * 63, 10, limit=64) == ([], 10)  # shorter: a torn line, it waits


def test_the_writer_never_writes_a_line_the_reader_would_refuse():
    with pytest.raises(H.ContractError, match="progress: field 'step' is -3"):
        H.encode(H.Progress(step=-3))
    with pytest.raises(H.ContractError, match="metrics: field 'step' is 1.5"):
        H.encode(H.Metrics(step=1.5, values={}))


def test_every_field_type_has_a_reading_rule():
    """A field whose type no rule covers would make every line of its kind raise, not refuse."""
    for kind, cls in H.KINDS.items():
        assert set(H.SPECS[kind]) == {f.name for f in fields(cls)}
        H.from_mapping(json.loads(H.encode(H.stamp(SAMPLES[kind], seq=0, ts=0.0))))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or "").split(".")[0])
    return names


def test_the_contract_is_stdlib_only_and_core_init_imports_nothing():
    """Both travel to hosts that may have nothing but Python and torch."""
    assert _imports(CORE / "host_contract.py") <= {"__future__", "json", "math", "types", "typing", "dataclasses",
                                                  "pathlib"}
    assert _imports(CORE / "__init__.py") == set()
    assert _imports(CORE / "placeholders.py") <= {"__future__", "json", "string"}


def test_the_host_side_imports_nothing_of_core_but_what_travels():
    """A bundle carries core/__init__.py, host_contract.py and placeholders.py only (core/bundle.py)."""
    from orbit_dagster.core.bundle import RUNTIME_CORE_FILES, RUNTIME_PACKAGES

    pkg = CORE.parent
    shipped = {"core." + f.removesuffix(".py") for f in RUNTIME_CORE_FILES if f != "__init__.py"}
    for path in [p for name in RUNTIME_PACKAGES for p in (pkg / name).glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and (node.module or "").startswith("core"):
                modules = {node.module} if node.module != "core" else {f"core.{a.name}" for a in node.names}
                assert modules <= shipped, f"{path.name} imports {node.module}"


def test_a_field_added_to_an_older_kind_raises_the_lines_version_and_an_older_line_cannot_carry_it():
    plain = H.Checkpoint(step=8, tier="durable", uri="file:///s/j/step-000000008-a1", sha256="a" * 64, bytes=1,
                         attempt=1)
    assert H.version_of(plain) == 1  # what a version-1 control plane reads, as before
    planned = SAMPLES["checkpoint"]
    assert H.version_of(planned) == 2 and json.loads(H.encode(H.stamp(planned, seq=1, ts=0.0)))["contract"] == 2
    line = json.loads(H.encode(H.stamp(planned, seq=1, ts=0.0)))
    line["contract"] = 1
    (refused,), _ = H.read_chunk((json.dumps(line) + "\n").encode(), 0)
    assert isinstance(refused, H.Rejected) and "plan" in refused.reason and "version 1" in refused.reason


def test_the_local_disk_tier_is_version_3_and_a_version_2_line_cannot_carry_it():
    local_first = H.Checkpoint(step=8, tier="emergency", uri="file:///s/j/step-000000008-a1", sha256="a" * 64, bytes=1,
                               attempt=1, plan="full", plan_fits=True, plan_tier="local", local_seconds=0.2,
                               upload_seconds=3.5)
    assert H.version_of(local_first) == 3 and H.version_of(SAMPLES["local_checkpoint"]) == 3
    line = json.loads(H.encode(H.stamp(local_first, seq=1, ts=0.0)))
    line["contract"] = 2
    (refused,), _ = H.read_chunk((json.dumps(line) + "\n").encode(), 0)
    assert isinstance(refused, H.Rejected) and "local_seconds, plan_tier, upload_seconds" in refused.reason
    assert "local_checkpoint: a kind of contract version 3" in refusal(
        '{"type": "local_checkpoint", "step": 1, "attempt": 1, "uri": "u", "sha256": "s", "bytes": 1, "seconds": 1, '
        '"contract": 2}').reason


def test_a_command_workloads_local_copy_has_no_sha256_and_is_still_version_3():
    """The agent reports a script's own files before uploading them, unhashed (runtime/command.py):
    the line leaves `sha256` out and reads back as None, still version 3."""
    unhashed = H.LocalCheckpoint(step=8, attempt=2, uri="file:///instance/checkpoints/ckpt_8.pt",
                                 bytes=1234, seconds=0.4)
    line = json.loads(H.encode(H.stamp(unhashed, seq=1, ts=0.0)))
    assert "sha256" not in line and line["contract"] == 3 and H.version_of(unhashed) == 3
    (back,), _ = H.read_chunk((json.dumps(line) + "\n").encode(), 0)
    assert back.sha256 is None and back.bytes == 1234 and back.time_left_s is None


def test_a_local_checkpoint_whose_optional_sha256_is_not_a_string_is_refused_naming_the_field():
    line = {"type": "local_checkpoint", "seq": 1, "ts": 0.0, "contract": 3, "step": 8, "attempt": 2,
            "uri": "file:///instance/checkpoints/ckpt_8.pt", "bytes": 1234, "seconds": 0.4}
    for bad in (5, ["a"], {"x": 1}):
        (refused,), _ = H.read_chunk((json.dumps({**line, "sha256": bad}) + "\n").encode(), 0)
        assert isinstance(refused, H.Rejected) and "sha256" in refused.reason, bad
    (null,), _ = H.read_chunk((json.dumps({**line, "sha256": None}) + "\n").encode(), 0)
    assert isinstance(null, H.LocalCheckpoint) and null.sha256 is None
