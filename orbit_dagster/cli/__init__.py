"""The `orbit` command line: its commands (`commands.py`), its one-line errors (`errors.py`)
and the demo (`cli/demo.py`). `python -m orbit_dagster.cli` runs it."""
