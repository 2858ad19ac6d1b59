"""Issue 16, item 8: what comes from outside is data, read within bounds, and a bad name is
a refusal.

- `orbit import-run DIR` never executes anything of DIR (a template is code: only an
  installed one is used);
- a YAML alias bomb is refused at once, and no error message formats a huge value;
- every file from outside is size-checked before it is read and read in bounded chunks
  (a 2 GB state declared as 1 byte, a 500 MB template, trace or price file), so the
  refusing process stays small;
- a NUL byte (or a hostile shape) in a name, manifest, state or path is exit 2 naming the
  field, never an internal error.
The files that would need gigabytes are sparse (`os.truncate`): no disk, no RAM.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orbit_dagster.core.config_schema import show
from orbit_dagster.core.errors import TemplateError
from orbit_dagster.core.templates import MAX_TEMPLATE_BYTES, parse_template
from orbit_dagster.settings import Settings
from orbit_dagster.storage.base import MANIFEST, CheckpointManifest
from tests.helpers import run_cli
from tests.reliability import inject
from tests.security.measure import orbit

# 9 levels of 9 aliases: ~400 bytes that stand for 9^10 strings ("billion laughs").
BOMB = "\n".join(["name: bomb", "workload: charlm", 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
                 + [f"{b}: &{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")]
                 + ["description: *i"]) + "\n"


run = run_cli  # `orbit ARGV` in this process: (exit code, stdout, stderr)


def refusal(code: int, out: str, err: str) -> str:
    """The one error line of a refusal: exit 2, never `internal error` (exit 1)."""
    lines = err.strip().splitlines()
    assert code == 2 and lines and lines[-1].startswith("error: ") and "fix:" in lines[-1], (code, err[-600:])
    assert "internal error" not in err and "Traceback" not in out + err
    return lines[-1]


def manifest_for(d: Path, files: dict[str, dict]) -> None:
    (d / MANIFEST).write_text(CheckpointManifest(job_id="x", step=1, tier="durable", files=files, attempt=1).to_json())


# ---- nothing of DIR is executed -------------------------------------------------------------

def test_import_run_never_executes_a_template_or_config_py_of_the_imported_directory(orbit_home, tmp_path):
    """Old code: run.json naming a template in DIR loaded it, which imported DIR's config.py."""
    from orbit_dagster.control.importer import import_run

    marker = tmp_path / "executed"
    src = tmp_path / "run"
    inject.tiny_state(src / "ckpt-1" / "state.pt")
    (src / "config.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                   "from pydantic import BaseModel, ConfigDict\n"
                                   "class Config(BaseModel):\n    model_config = ConfigDict(extra='forbid')\n")
    for script in ("train.py", "eval.py"):
        (src / script).write_text("")
    (src / "theirs.yaml").write_text(f"name: theirs\nworkload: {src}\n")
    (src / "run.json").write_text(json.dumps({"template": str(src / "theirs.yaml")}))
    Settings.from_env(orbit_home).ledger().dispose()
    # By path, through the CLI run from inside DIR (where a relative name would be looked for).
    proc = subprocess.run([sys.executable, "-m", "orbit_dagster.cli", "import-run", str(src)], cwd=src,
                          env={**os.environ, "ORBIT_HOME": str(orbit_home)}, capture_output=True, text=True,
                          timeout=300)
    assert not marker.exists(), "the imported directory's config.py ran"
    assert proc.returncode == 0, proc.stderr[-500:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["evaluable"] is False and "not an installed template" in result["note"]
    assert "note: " in proc.stderr and "without a config schema" in proc.stderr
    ledger = Settings.from_env(orbit_home).ledger()
    assert ledger.scalar("SELECT template FROM jobs WHERE job_id = ?", [result["job_id"]]) is None
    assert ledger.scalar("SELECT count(*) FROM evaluations") == 0
    # By a name that is not installed (the file sits in DIR, the working directory here).
    (src / "run.json").write_text(json.dumps({"template": "theirs"}))
    cwd = os.getcwd()
    os.chdir(src)
    try:
        result = import_run(Settings.from_env(orbit_home), src, name="again")
    finally:
        os.chdir(cwd)
    assert not marker.exists() and result["evaluable"] is False and "'theirs'" in result["note"]


# ---- YAML expansion, and values shown in errors ---------------------------------------------

def test_a_yaml_alias_bomb_is_refused_within_a_second_naming_the_file(tmp_path, orbit_home):
    """Old code: `orbit submit` of this 400-byte template hung (repr() of 10^9 values)."""
    assert len(BOMB) < 600
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    # In a process of its own with a deadline: a regression fails here in seconds, never hangs.
    snippet = ("import sys, time; from orbit_dagster.core.templates import load_template; t = time.monotonic()\n"
               "try:\n    load_template(sys.argv[1])\nexcept Exception as exc:\n"
               "    print(f'{time.monotonic() - t:.3f}', type(exc).__name__, exc)\n")
    proc = subprocess.run([sys.executable, "-c", snippet, str(path)], capture_output=True, text=True, timeout=4.5,
                          env={**os.environ, "ORBIT_HOME": str(orbit_home)})
    seconds, kind, message = proc.stdout.split(" ", 2)
    assert kind == "TemplateError" and float(seconds) < 1.0, proc.stdout
    assert str(path) in message and "aliases expand" in message and "fix:" in message, message
    code, out, err = run(["submit", str(path)])  # and through the CLI: one line, exit 2
    assert "aliases expand" in refusal(code, out, err)


def test_yaml_anchors_for_small_blocks_still_load_and_cycles_or_deep_nesting_are_refused():
    template = parse_template("name: x\nworkload: charlm\nenv: &e {A: '1'}\ndescription: &d short\n"
                              "allow_overrides: &o [config.lr]\nresume_compatible: *o\n", source="x.yaml")
    assert template.env == {"A": "1"} and template.resume_compatible == ("config.lr",)
    for text, words in (("name: x\nworkload: charlm\ndescription: &a [*a]\n", "cycle"),
                        ("name: x\nworkload: charlm\ndescription: " + "[" * 20000 + "]" * 20000 + "\n", "nests")):
        with pytest.raises(TemplateError, match=words):
            parse_template(text, source="x.yaml")


def test_show_cuts_a_value_before_formatting_it(orbit_home):
    """Old code: show() ran repr() of the whole value, then cut it to 60 characters. In a
    process of its own with a deadline, so that a regression fails in seconds."""
    snippet = ("import time; from orbit_dagster.core.config_schema import show\n"
               "bomb = ['lol'] * 9\n"
               "for _ in range(9):\n    bomb = [bomb] * 9\n"  # 9^10 strings, as a YAML alias bomb constructs them
               "t = time.monotonic(); text = show(bomb); print(f'{time.monotonic() - t:.3f}', text)\n")
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=4.5,
                          env={**os.environ, "ORBIT_HOME": str(orbit_home)})
    seconds, text = proc.stdout.strip().split(" ", 1)
    assert float(seconds) < 0.5 and len(text) < 120 and "list of 9 items" in text, proc.stdout
    assert show("x" * (1 << 20)).endswith("(1048576 characters)") and show(10 ** 5000) == "<int>"


# ---- sizes checked before reading -----------------------------------------------------------

def test_a_state_declared_as_1_byte_but_2_gb_is_refused_before_it_is_read(orbit_home, tmp_path):
    """Old code: the 2 GB state.pt was read whole (2.15 GB RSS), then found not to match."""
    src = tmp_path / "run"
    (src / "ckpt-1").mkdir(parents=True)
    (src / "ckpt-1" / "state.pt").touch()
    os.truncate(src / "ckpt-1" / "state.pt", 2 << 30)  # sparse: no disk
    manifest_for(src / "ckpt-1", {"state.pt": {"sha256": hashlib.sha256(b"x").hexdigest(), "bytes": 1}})
    Settings.from_env(orbit_home).ledger().dispose()
    m = orbit(["import-run", str(src)], home=orbit_home, timeout=120)
    line = refusal(m.rc, m.out, m.err)
    assert "ckpt-1/state.pt" in line and "declared 1 byte" in line, line
    assert m.peak_rss < 400 << 20, f"peak RSS {m.peak_rss >> 20} MiB"
    assert m.seconds < 60, m.seconds
    assert Settings.from_env(orbit_home).ledger().scalar("SELECT count(*) FROM jobs") == 0


def test_a_state_larger_than_a_quarter_of_memory_is_refused_by_its_size(orbit_home, tmp_path):
    """Old code: the cap was 64 GiB, above this machine's memory: a state under it was read whole."""
    src = tmp_path / "run"
    (src / "ckpt-1").mkdir(parents=True)
    state = src / "ckpt-1" / "state.pt"
    state.touch()
    quarter = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    os.truncate(state, min(64 << 30, quarter) + 1)  # sparse
    Settings.from_env(orbit_home).ledger().dispose()
    m = orbit(["import-run", str(src)], home=orbit_home, timeout=120)
    line = refusal(m.rc, m.out, m.err)
    assert "ckpt-1/state.pt" in line and "the limit of" in line and "memory" in line, line
    assert m.peak_rss < 400 << 20, f"peak RSS {m.peak_rss >> 20} MiB"


def test_a_named_template_over_the_limit_is_refused_by_stat(orbit_home, tmp_path):
    """Old code: a template given by name was read whole (1 GB RSS for 500 MB) before its size
    was checked; given by path it was refused at once."""
    (orbit_home / "templates").mkdir(parents=True)
    big = orbit_home / "templates" / "big.yaml"
    big.touch()
    os.truncate(big, 500 << 20)
    m = orbit(["submit", "big"], home=orbit_home, timeout=120)
    line = refusal(m.rc, m.out, m.err)
    assert "template big" in line and f"{MAX_TEMPLATE_BYTES:,} bytes" in line, line
    assert m.peak_rss < 300 << 20, f"peak RSS {m.peak_rss >> 20} MiB"


def test_trace_and_price_files_over_their_limit_are_refused_by_size(tmp_path, orbit_home):
    """Old code: `orbit simulate --trace` and the AWS price file were read whole, any size."""
    from orbit_dagster.catalog import CatalogError
    from orbit_dagster.catalog.aws import parse_spot_price_history
    from orbit_dagster.catalog.traces import TraceFormatError, load_trace

    huge = tmp_path / "trace.json"
    huge.touch()
    os.truncate(huge, 300 << 20)
    with pytest.raises(TraceFormatError, match="the limit of"):
        load_trace(huge)
    code, out, err = run(["simulate", "--trace", str(huge)])
    assert "the limit of" in refusal(code, out, err)
    prices = tmp_path / "aws_spot_prices.tsv"
    prices.touch()
    os.truncate(prices, 300 << 20)
    with pytest.raises(CatalogError, match="the limit of"):
        parse_spot_price_history(prices)


def test_read_bounded_stops_at_the_declared_size_plus_one_byte(tmp_path):
    from orbit_dagster.core.bounded import TooLarge, read_bounded

    f = tmp_path / "f"
    f.write_bytes(b"abc")
    digest = hashlib.sha256()
    assert read_bounded(f, 10, what="f", field="f", fix="x", declared=3, digest=digest) == b"abc"
    assert digest.hexdigest() == hashlib.sha256(b"abc").hexdigest()
    for declared, words in ((2, "more than its declared 2 bytes"), (4, "less than its declared 4 bytes")):
        with pytest.raises(TooLarge, match=words):
            read_bounded(f, 10, what="f", field="f", fix="x", declared=declared)
    with pytest.raises(TooLarge, match="the limit of 2 bytes"):
        read_bounded(f, 2, what="f", field="f", fix="x")


def test_host_event_files_are_read_in_bounded_steps_and_hostile_lines_are_skipped(tmp_path):
    """Old code: the whole rest of events.jsonl was read at each poll, and a line nested
    thousands deep raised RecursionError out of the reader. Hostile lines are refused by
    name (the follower records them), never raised."""
    from orbit_dagster.core.host_contract import Progress, Rejected
    from orbit_dagster.providers.common import read_event_file

    EVENTS_READ_MAX = 4 << 20  # what one poll may read (as the SSH provider reads)

    path = tmp_path / "events.jsonl"
    good = json.dumps({"seq": 1, "type": "progress", "step": 3})
    path.write_bytes(b"x" * (2 * EVENTS_READ_MAX) + b"\n" + ("[" * 100000 + "]" * 100000 + "\n").encode()
                     + good.encode() + b"\n")
    offset, events, calls = 0, [], 0
    while offset < path.stat().st_size and calls < 20:
        got, new = read_event_file(path, offset)
        assert new - offset <= EVENTS_READ_MAX
        events += got
        offset, calls = new, calls + 1
    assert [e for e in events if not isinstance(e, Rejected)] == [Progress(seq=1, step=3)]
    assert offset == path.stat().st_size
    reasons = [e.reason for e in events if isinstance(e, Rejected)]
    assert reasons[0] == f"a line longer than {EVENTS_READ_MAX} bytes" and "not a JSON line (RecursionError)" in reasons


# ---- NUL bytes and hostile shapes are refusals ----------------------------------------------

def hostile_imports(src: Path) -> dict[str, callable]:
    def nul_in_manifest_name():
        inject.tiny_state(src / "ckpt-1" / "state.pt")
        manifest_for(src / "ckpt-1", {"state\0.pt": {"sha256": "0" * 64, "bytes": 1}})

    def manifest_entry_not_a_mapping():
        inject.tiny_state(src / "ckpt-1" / "state.pt")
        (src / "ckpt-1" / MANIFEST).write_text(json.dumps({"job_id": "x", "step": 1, "tier": "durable",
                                                          "files": {"state.pt": "big"}}))

    def manifest_nested_deep():
        inject.tiny_state(src / "ckpt-1" / "state.pt")
        (src / "ckpt-1" / MANIFEST).write_text("[" * 100000 + "]" * 100000)

    def state_of_numbers_not_tensors():
        import torch

        (src / "ckpt-1").mkdir(parents=True)
        torch.save({"model": {"w": 1}, "step": 1}, src / "ckpt-1" / "state.pt")

    def run_json_nested_deep():
        inject.tiny_state(src / "ckpt-1" / "state.pt")
        (src / "run.json").write_text("[" * 100000 + "]" * 100000)

    def nul_in_run_json_experiment():
        inject.tiny_state(src / "ckpt-1" / "state.pt")
        (src / "run.json").write_text(json.dumps({"experiment": "a\0b"}))

    def nul_in_metric_name():
        inject.tiny_state(src / "ckpt-1" / "state.pt")
        (src / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/\0loss": 1.0}) + "\n")

    def nan_metric():
        inject.tiny_state(src / "ckpt-1" / "state.pt")
        (src / "metrics.jsonl").write_text('{"step": 1, "train/loss": NaN}\n')

    def metric_line_of_a_megabyte():
        inject.tiny_state(src / "ckpt-1" / "state.pt")
        (src / "metrics.jsonl").write_text(json.dumps({"step": 1, "x" * (1 << 20): 1.0}) + "\n")

    return {f.__name__: f for f in (nul_in_manifest_name, manifest_entry_not_a_mapping, manifest_nested_deep,
                                    state_of_numbers_not_tensors, run_json_nested_deep, nul_in_run_json_experiment,
                                    nul_in_metric_name, nan_metric, metric_line_of_a_megabyte)}


@pytest.mark.parametrize("case", list(hostile_imports(Path("/x"))))
def test_a_hostile_import_is_a_refusal_naming_the_field_never_an_internal_error(orbit_home, tmp_path, case):
    """Old code: a NUL in a manifest name was `internal error (ValueError)`, exit 1; so were
    a manifest entry that is not a mapping, a state of numbers, deep nesting (RecursionError);
    a NaN metric was stored."""
    src = tmp_path / "run"
    src.mkdir()
    hostile_imports(src)[case]()
    Settings.from_env(orbit_home).ledger()
    refusal(*run(["import-run", str(src)]))
    assert Settings.from_env(orbit_home).ledger().scalar("SELECT count(*) FROM jobs") == 0


@pytest.mark.parametrize("argv,field", [
    (["import-run", "a\0b"], "DIR"),
    (["simulate", "--trace", "a\0b"], "--trace"),
    (["submit", "{template}"], "env.A"),
    (["submit", "{template}", "--experiment", "a\0b"], "experiment"),
    (["status", "a\0b"], "job"),
])
def test_a_nul_byte_in_a_path_or_name_is_a_refusal_naming_it(orbit_home, tmp_path, argv, field):
    """Old code: `import-run` and `simulate --trace` of a path with a NUL, and a template whose
    env value holds one (accepted, then failing on the host), were internal errors or accepted."""
    template = tmp_path / "nul.yaml"
    template.write_text('name: nul\nworkload: charlm\nenv: {A: "x\\0y"}\n')
    argv = [a.replace("{template}", str(template)) for a in argv]
    line = refusal(*run(argv))
    assert field in line, line
