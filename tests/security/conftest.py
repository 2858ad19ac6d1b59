"""The fault table's hooks (see tests/reliability/faults.py): security tests are rows of it too."""
from tests.reliability.faults import (  # noqa: F401 - pytest finds hooks by name
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_terminal_summary,
)
