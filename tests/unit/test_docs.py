"""The documentation stays true of the code in what a test can check without running anything:

- every `orbit ...` command line in README.md and docs/*.md (shell code blocks, `$ ` lines of
  plain blocks, systemd units' `ExecStart=`, inline code) parses against the real click CLI: no unknown command, no unknown
  option, no option without its value, no extra argument, no value a choice or a type refuses
  (placeholders such as JOB, EXP, FILE, N stand for any value);
- every module path a page names exists, and every test it names is in the suite;
- every `ORBIT_*` variable a page names is read by the package;
- every bench command in docs/benchmarks.md rewrites its own section (`--record
  docs/benchmarks.md` for the scripts that have that flag), and every recorded section names
  the command that wrote it.
"""
from __future__ import annotations

import ast
import itertools
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import click
import pytest

from orbit_dagster.cli.commands import cli

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PACKAGE = REPO / "orbit_dagster"
SHELL_BLOCKS = {"bash", "sh", "shell", "console", "sh-session"}


# ---- reading the pages -----------------------------------------------------------------------

@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    text: str
    where: str  # "block" (a shell block's line), "prompt" (`$ ` in a plain block), "inline"

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text!r}"


FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def snippets(path: Path) -> list[Snippet]:
    """Shell lines of fenced blocks (and `ExecStart=` of units) and inline code spans (which
    may wrap a line) of one page."""
    out: list[Snippet] = []
    name = str(path.relative_to(REPO))
    lines = path.read_text(encoding="utf-8").splitlines()
    prose: list[tuple[int, str]] = []
    fence, lang = None, ""
    pending = ""  # a shell line continued with a backslash
    for no, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence, lang = m.group(2), m.group(3).lower()
            continue
        if fence is not None:
            if line.strip().startswith(fence[0] * 3) and line.strip().strip(fence[0]) == "":
                fence = None
                continue
            text = line.strip()
            if lang in SHELL_BLOCKS:
                if text.endswith("\\"):
                    pending += text[:-1] + " "
                    continue
                out.append(Snippet(name, no, pending + text, "block"))
                pending = ""
            elif lang == "" and text.startswith("$ "):
                out.append(Snippet(name, no, text[2:], "prompt"))
            elif lang == "ini" and text.startswith("ExecStart="):  # a systemd unit's command
                out.append(Snippet(name, no, text.removeprefix("ExecStart="), "block"))
            continue
        prose.append((no, line))
    # Inline code spans: joined over line breaks, as Markdown renders them.
    text = "\n".join(line for _, line in prose)
    starts = list(itertools.accumulate([0] + [len(line) + 1 for _, line in prose]))
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.DOTALL):
        row = next(i for i, s in enumerate(starts) if s > m.start()) - 1
        out.append(Snippet(name, prose[row][0], " ".join(m.group(2).split()), "inline"))
    return out


@cache
def all_snippets() -> tuple[Snippet, ...]:
    return tuple(s for page in PAGES for s in snippets(page))


def page_texts() -> list[tuple[str, str]]:
    return [(str(p.relative_to(REPO)), p.read_text(encoding="utf-8")) for p in PAGES]


# ---- finding `orbit` command lines --------------------------------------------------------------

OPERATORS = {";", "&&", "||", "|", "&", "(", ")", "((", "))", ">", ">>", "<", "<<", ">&", "<&", "|&", ";;"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_words(text: str) -> list[str] | None:
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote: not a command line
        return None


def orbit_commands(text: str) -> list[list[str]]:
    """The argument lists of the `orbit` commands in one shell line (also inside `bash -c '...'`)."""
    words = shell_words(text)
    if words is None:
        return []
    found: list[list[str]] = []
    command: list[str] = []
    for word in [*words, ";"]:
        if word not in OPERATORS:
            command.append(word)
            continue
        if word.startswith((">", "<")) and command and command[-1].isdigit():
            command.pop()  # `2>&1`: the descriptor is not an argument
        found += _orbit_of(command)
        command = []
    return found


def _orbit_of(command: list[str]) -> list[list[str]]:
    words = list(command)
    while words and (ASSIGNMENT.match(words[0]) or words[0] in ("$", "exec", "time", "env")):
        words.pop(0)
    if not words:
        return []
    if words[0] == "orbit" or words[0].endswith("/orbit"):
        return [words[1:]]
    if "-c" in words[:-1]:  # `sudo -u orbit bash -c '...; orbit profile'`
        return orbit_commands(words[words.index("-c") + 1])
    return []


ALTERNATIVE = re.compile(r"(?<![\s|])\|(?![\s|])")


def _alternatives(token: str) -> list[str]:
    """`min|max` -> both; a shell pipe (`|` alone) or a quoted word stays as it is."""
    parts = ALTERNATIVE.split(token)
    return parts if len(parts) > 1 and all(parts) and not token.startswith(("'", '"')) else [token]


def variants(text: str) -> list[str]:
    """A synopsis as command lines: `[--a X | --b]` and `min|max` give one line per alternative
    (optional parts included, so that each is checked)."""
    groups = [[a.strip() for a in g.split(" | ")] for g in re.findall(r"\[([^\[\]]*)\]", text)]
    tokens = re.split(r"(\s+)", re.sub(r"\[[^\[\]]*\]", "\0", text))
    words = [_alternatives(t) for t in tokens]
    out = []
    for k in range(max([len(a) for a in groups + words] + [1])):
        line = "".join(_pick(a, k) for a in words)
        for group in groups:
            line = line.replace("\0", _pick(group, k), 1)
        out.append(line)
    return list(dict.fromkeys(out))


def _pick(alternatives: list[str], k: int) -> str:
    return alternatives[min(k, len(alternatives) - 1)]


def doc_commands() -> list[tuple[Snippet, list[str]]]:
    found = []
    for s in all_snippets():
        if "orbit " not in s.text:
            continue
        for text in variants(s.text):
            for args in orbit_commands(text):
                found.append((s, args))
    return found


# ---- checking one command against click -----------------------------------------------------

PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:\.\.\.)?|<[^>]*>|\.\.\.|.*\.\.\..*|\$\w+|\$\{.*\})$")


def is_placeholder(value: str) -> bool:
    return bool(PLACEHOLDER.match(value))


def check_args(args: list[str], group: click.Group = cli, path: str = "orbit") -> str | None:
    """Why click refuses these arguments of `path`, or None. Parses only: nothing runs."""
    ctx = click.Context(group, info_name=path, resilient_parsing=False)  # its parser then raises what it finds
    try:
        _, rest, _ = group.make_parser(ctx).parse_args(list(args))
    except click.UsageError as err:
        return f"{path}: {err.format_message()}"
    if not rest:
        return None
    name, tail = rest[0], rest[1:]
    sub = group.get_command(ctx, name)
    if sub is None:
        return f"{path}: no such command {name!r} (commands: {', '.join(sorted(group.list_commands(ctx)))})"
    if isinstance(sub, click.Group):
        return check_args(tail, sub, f"{path} {name}")
    return check_command(sub, tail, f"{path} {name}")


def check_command(command: click.Command, args: list[str], path: str) -> str | None:
    ctx = click.Context(command, info_name=path, resilient_parsing=False)  # its parser then raises what it finds
    try:
        opts, extra, _ = command.make_parser(ctx).parse_args(list(args))
    except click.UsageError as err:
        return f"{path}: {err.format_message()}"
    if extra:
        return f"{path}: unexpected extra argument(s) {extra}"
    for param in command.params:
        value = opts.get(param.name)
        if value is None or param.name not in opts:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if not isinstance(v, str) or is_placeholder(v):
                continue
            try:
                param.type.convert(v, param, ctx)
            except click.BadParameter as err:
                return f"{path}: {param.name}={v!r}: {err.format_message()}"
    return None


# ---- the tests ------------------------------------------------------------------------------

def test_the_pages_show_orbit_commands_to_check():
    """The extraction finds what the pages show: a broken reader would make the next test empty."""
    found = doc_commands()
    names = {args[0] for _, args in found if args}
    assert len(found) >= 60, len(found)
    assert {"submit", "retry", "status", "best", "cost", "sql", "ledger", "demo", "daemon", "ui", "profile",
            "simulate", "offers", "code-server", "metric", "import-run", "cancel", "logs"} <= names, names


def test_every_orbit_command_line_in_the_docs_parses_against_the_cli():
    bad = [f"{s}: {why}" for s, args in doc_commands() if (why := check_args(args))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("line, expected", [
    ("orbit statsu", "no such command 'statsu'"),
    ("orbit status --jsn", "No such option"),
    ("orbit cost --by week", "week"),
    ("orbit logs JOB --attempt", "requires an argument"),
    ("orbit daemon pid 18114", "unexpected extra argument"),
    ("orbit ledger upgrad", "no such command 'upgrad'"),
    ("orbit ui --port abc", "abc"),
])
def test_a_wrong_command_line_is_refused(line, expected):
    (args,) = orbit_commands(line)
    why = check_args(args)
    assert why is not None and expected in why, why


@pytest.mark.parametrize("line, commands", [
    ("ORBIT_PROFILE=team ORBIT_POSTGRES_URL=postgresql://o@h:5432/o orbit profile", [["profile"]]),
    ("sudo -u orbit bash -c 'set -a; . /srv/orbit/orbit.env; cd /srv; exec .venv/bin/orbit daemon' >>/var/log/x 2>&1 &",
     [["daemon"]]),
    ("orbit daemon | orbit ui  # both", [["daemon"], ["ui"]]),
    ("sudo -u orbit git clone REPO /srv/orbit", []),
    ('orbit sql "SELECT * FROM cost_by_job"', [["sql", "SELECT * FROM cost_by_job"]]),
])
def test_command_lines_are_found_as_a_shell_reads_them(line, commands):
    assert orbit_commands(line) == commands


def test_synopsis_alternatives_are_each_checked():
    assert variants("orbit cost --by job|experiment|checkpoint") == [
        "orbit cost --by job", "orbit cost --by experiment", "orbit cost --by checkpoint"]
    assert variants("orbit code-server [--socket PATH | --port N]") == [
        "orbit code-server --socket PATH", "orbit code-server --port N"]


# Module paths: under orbit_dagster/ (also written from inside the package: `control/attempt.py`),
# tests/, bench/, scripts/.
TOP = ("orbit_dagster", "tests", "bench", "scripts")
PATH_RE = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.py)\b")


def module_paths() -> list[tuple[str, str]]:
    """Paths of this repository's Python files a page names: under a top directory, or under
    one of the package's subpackages (other paths, such as the standard library's in a
    profile, are not ours)."""
    ours = set(TOP) | {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_")}
    return [(page, m.group(1)) for page, text in page_texts() for m in PATH_RE.finditer(text)
            if m.group(1).split("/")[0] in ours]


def resolves(path: str) -> bool:
    if path.split("/")[0] in TOP:
        return (REPO / path).is_file()
    return (PACKAGE / path).is_file()


def test_every_module_path_a_page_names_exists():
    found = module_paths()
    assert len(found) >= 40, found  # the pages name many: a broken pattern would find none
    missing = sorted({f"{page}: {path}" for page, path in found if not resolves(path)})
    assert not missing, "\n".join(missing)


# A bare file name in inline code (`checkpointing.py`) names one of this repository's files.
BARE_FILE = re.compile(r"^[\w.-]+\.py$")


def test_every_bare_file_name_a_page_names_exists():
    ours = {p.name for top in TOP for p in (REPO / top).rglob("*.py")}
    found = [s for s in all_snippets() if s.where == "inline" and BARE_FILE.match(s.text)]
    assert len(found) >= 10, found
    missing = sorted({str(s) for s in found if s.text not in ours})
    assert not missing, "\n".join(missing)


# Dotted names of the package in inline code (`policy.checkpointing.OrbitInterval`,
# `orbit_dagster.storage.s3.S3Store`, `ledger.queries.sql(...)`, `control/dispatch.checkpoint_plan`): the module exists and defines
# the name (a def, a class or an assignment in it; a method or attribute after a class is
# looked for in the same file). Read as text: importing would load Dagster.
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
# Three parts at least without the package's name: `ledger.sqlite` is a file, `resources.gpu` a field.
DOTTED = re.compile(rf"^(?:orbit_dagster\.((?:{'|'.join(SUBPACKAGES)})(?:\.\w+)+)|((?:{'|'.join(SUBPACKAGES)})"
                    rf"(?:\.\w+){{2,}}))(?:\(.*\))?$")


FILE_SUFFIX = re.compile(r"\.(?:py|md|json|ya?ml|csv|gz|tsv|txt|toml|sh|sqlite|duckdb|pt|png|log|lock|sock)\b")


def resolve_dotted(name: str) -> str | None:
    """Why a dotted name does not resolve, or None."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = PACKAGE.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            break
    else:
        return f"no module for {name}"
    text = module.read_text(encoding="utf-8")
    for attr in parts[cut:]:
        if not re.search(rf"^\s*(?:async def|def|class) {attr}\b|^\s*{attr}\s*[:=]|\bimport\b.*\b{attr}\b|"
                         rf"^\s*self\.{attr}\s*[:=]|\b{attr}\s*=", text, re.MULTILINE):
            return f"{module.relative_to(REPO)} defines no {attr!r}"
    return None


def test_every_dotted_name_of_the_package_a_page_names_exists():
    found = [(s, m.group(1) or m.group(2)) for s in all_snippets() if s.where == "inline"
             and (m := DOTTED.match(s.text if FILE_SUFFIX.search(s.text) else s.text.replace("/", ".")))]
    assert len(found) >= 15, found
    bad = sorted({f"{s}: {why}" for s, name in found if (why := resolve_dotted(name))})
    assert not bad, "\n".join(bad)


def python_imports() -> list[tuple[str, str]]:
    """`from orbit_dagster.x import a, b` in the pages' Python blocks, as dotted names."""
    found = []
    for page, text in page_texts():
        for block in re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
            for module, names in re.findall(r"^from orbit_dagster\.([\w.]+) import ([\w, ]+)$", block, re.MULTILINE):
                found += [(page, f"{module}.{n.strip()}") for n in names.split(",") if n.strip()]
    return found


def test_every_import_in_a_python_block_exists():
    found = python_imports()
    assert len(found) >= 5, found
    bad = sorted({f"{page}: {name}: {why}" for page, name in found if (why := resolve_dotted(name))})
    assert not bad, "\n".join(bad)


# Checkpoint names as the pages write them (`<job>/step-<9 digits>-a<attempt>/` in a store, the
# ledger's key `<job>/a<attempt>/<step>`, a partition `a<attempt>/<step>`): each one, filled in,
# is what the code makes.
STORE_NAME = re.compile(r"step-<9 digits>[^\s`/)]*")
LEDGER_KEY = re.compile(r"<job>/(?:a<attempt>/)?<step>")


def test_checkpoint_names_in_the_pages_are_the_ones_the_code_makes():
    from orbit_dagster.ledger.records import checkpoint_key
    from orbit_dagster.storage.base import checkpoint_dir_name

    def fill(text: str) -> str:
        return text.replace("<9 digits>", f"{120:09d}").replace("<attempt>", "2").replace("<step>", "120") \
            .replace("<job>", "J")

    texts = page_texts()
    names = [(page, m.group(0)) for page, text in texts for m in STORE_NAME.finditer(text)]
    keys = [(page, m.group(0)) for page, text in texts for m in LEDGER_KEY.finditer(text)]
    assert names and keys
    wrong = [f"{page}: {n}" for page, n in names if fill(n) != checkpoint_dir_name(120, 2)]
    wrong += [f"{page}: {k}" for page, k in keys if fill(k) != checkpoint_key("J", 2, 120)]
    assert not wrong, "\n".join(wrong)


# Test names: a page that names a test (`test_...`, or `tests/...py::test_...`) names one the
# suite has: a test function, or a test module. A name ending in `_` is a prefix (`test_defect_2_*`).
TEST_NAME = re.compile(r"(?<![\w/.-])(test_[a-z0-9_]*[a-z0-9])\b(?!\.py)")


@cache
def suite_names() -> frozenset[str]:
    names = {p.stem for p in (REPO / "tests").rglob("test_*.py")}
    for path in (REPO / "tests").rglob("*.py"):
        names |= set(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(encoding="utf-8"), re.MULTILINE))
    return frozenset(names)


def test_every_test_a_page_names_is_in_the_suite():
    found = [(page, m.group(1)) for page, text in page_texts() for m in TEST_NAME.finditer(text)]
    assert len(found) >= 50, found
    missing = sorted({f"{page}: {name}" for page, name in found if name not in suite_names()})
    assert not missing, "\n".join(missing)


# `ORBIT_*` settings: each one a page names is read by the code (a string literal that is the
# name): the package's settings, or the knobs of the
# test suite and benchmarks that a page tells how to turn. Names the user chooses, which an
# example shows, are not settings.
USER_NAMED = {"ORBIT_BOX1_KEY", "ORBIT_BOX1_PASSPHRASE"}
VAR_RE = re.compile(r"\bORBIT_[A-Z0-9_]*[A-Z0-9](?:_\*)?|\bORBIT_[A-Z0-9_]+_\*")


@cache
def names_read_by_the_package() -> frozenset[str]:
    """Names the code reads: a string literal that is exactly the name (`os.environ.get("ORBIT_X")`,
    `_seconds("ORBIT_X", 60.0)`), not a mention in prose. Read as text: parsing every module is
    ten times slower."""
    literal = re.compile(r"""(?<![\w'"])(["'])(ORBIT_[A-Z0-9_]+)\1""")
    names: set[str] = set()
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "tests").rglob("*.py"), *(REPO / "bench").glob("*.py")]:
        names |= {m.group(2) for m in literal.finditer(path.read_text(encoding="utf-8"))}
    return frozenset(names)


def documented_variables() -> list[tuple[str, str]]:
    return [(page, m.group(0)) for page, text in page_texts() for m in VAR_RE.finditer(text)]


def test_every_orbit_variable_a_page_names_is_read_by_the_code():
    read = names_read_by_the_package()
    found = documented_variables()
    assert len({name for _, name in found}) >= 30, found
    unread = []
    for page, name in found:
        if name in USER_NAMED:
            continue
        if name.endswith("_*"):
            ok = any(r.startswith(name[:-1]) for r in read)
        else:
            ok = name in read
        if not ok:
            unread.append(f"{page}: {name}")
    assert not unread, "\n".join(sorted(set(unread)))


# Bench commands: a section of docs/benchmarks.md is rewritten by its script between markers
# (`<!-- tag:begin -->`); re-running the command a section names must rewrite that section.
BENCH_DOC = REPO / "docs" / "benchmarks.md"
BENCH_CMD = re.compile(r"python bench/([\w-]+)\.py(?:\s+(?:--?[\w-]+(?:[ =](?!python\b)[^\s`-][^\s`]*)?|[^\s`-][^\s`]*))*")
MARKER = re.compile(r"<!-- ([\w-]+):begin -->(.*?)<!-- \1:end -->", re.DOTALL)


@cache
def record_flag(script: str) -> bool:
    """Whether bench/<script>.py takes `--record` (its argparse says so)."""
    tree = ast.parse((REPO / "bench" / f"{script}.py").read_text(encoding="utf-8"))
    return any(isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
               and any(isinstance(a, ast.Constant) and a.value == "--record" for a in node.args)
               for node in ast.walk(tree))


def section_owner(tag: str) -> set[str]:
    """The bench scripts whose source names this section's marker."""
    return {p.stem for p in (REPO / "bench").glob("*.py")
            if f"<!-- {tag}:begin -->" in p.read_text(encoding="utf-8")
            or re.search(rf"""record\([^)]*["']{re.escape(tag)}["']""", p.read_text(encoding="utf-8"))}


def bench_commands(text: str) -> list[tuple[str, str]]:
    flat = " ".join(text.split())
    return [(m.group(1), m.group(0)) for m in BENCH_CMD.finditer(flat)]


def test_every_bench_command_rewrites_its_own_section():
    text = BENCH_DOC.read_text(encoding="utf-8")
    found = bench_commands(text)
    assert len(found) >= 8, found
    wrong = [cmd for script, cmd in found
             if record_flag(script) and not re.search(r"--record[ =]docs/benchmarks\.md\b", cmd)]
    assert not wrong, "these commands do not rewrite their section (add `--record docs/benchmarks.md`):\n" + \
        "\n".join(wrong)


def test_every_recorded_section_names_the_command_that_writes_it():
    sections = MARKER.findall(BENCH_DOC.read_text(encoding="utf-8"))
    assert len(sections) >= 8, [tag for tag, _ in sections]
    unnamed = []
    for tag, body in sections:
        owners = section_owner(tag)
        assert owners, f"no bench script writes the section {tag!r}"
        if not any(script in owners for script, _ in bench_commands(body)):
            unnamed.append(f"{tag} (written by {', '.join(sorted(owners))})")
    assert not unnamed, "sections that do not name their command:\n" + "\n".join(unnamed)


def test_each_script_writes_a_command_that_rewrites_its_section_again():
    """What a script writes into its section names `--record docs/benchmarks.md` (through
    recording.recorded_command, or literally), so a re-run keeps the page true."""
    writers = sorted(p.stem for p in (REPO / "bench").glob("*.py") if record_flag(p.stem))
    assert len(writers) >= 10, writers
    ways = ("recorded_command(", "--record docs/benchmarks.md")
    silent = [w for w in writers if not any(way in (REPO / "bench" / f"{w}.py").read_text(encoding="utf-8") for way in ways)]
    assert not silent, silent
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    try:
        from recording import recorded_command
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert recorded_command("sizing", ["--jobs", "20", "--record", "/tmp/x.md"]) == \
        "python bench/sizing.py --jobs 20 --record docs/benchmarks.md"
    assert recorded_command("sensor_tick", ["--record=/tmp/x.md", "--quick"]) == \
        "python bench/sensor_tick.py --record docs/benchmarks.md --quick"
    # A local output (a file of raw clocks) is left out, with its value, in either spelling.
    assert recorded_command("step_overhead", ["--steps-out", "/tmp/c", "--pairs", "3", "--steps-out=/tmp/d",
                                              "--record", "/tmp/x.md"], leave_out=("--steps-out",)) == \
        "python bench/step_overhead.py --pairs 3 --record docs/benchmarks.md"


def test_a_bench_command_without_record_is_caught():
    assert not any("--record" in cmd for _, cmd in bench_commands("Command: `python bench/sizing.py --jobs 20 --follow 3`."))
    assert record_flag("sizing") and record_flag("checkpoint_io")
    (script, cmd), = bench_commands("Run `python bench/gpu_check.py --record docs/benchmarks.md` there")
    assert script == "gpu_check" and cmd.endswith("--record docs/benchmarks.md")
