"""`python -m orbit_dagster.settings`: print docs/deploy.md's table of every setting
(`--write PATH` replaces the table between its markers in that file)."""
from __future__ import annotations

import sys
from pathlib import Path

from .variables import markdown_table

BEGIN = "<!-- the settings table: made by `python -m orbit_dagster.settings --write docs/deploy.md` -->"
END = "<!-- end of the settings table -->"


def replaced(text: str) -> str:
    """`text` with the table between BEGIN and END made anew from the settings module."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"the file has no {BEGIN!r} ... {END!r} block")
    return f"{head}{BEGIN}\n{markdown_table()}{END}{tail}"


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--write":
        path = Path(argv[1])
        path.write_text(replaced(path.read_text()))
        return 0
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
