"""The ledger's errors: each names the database and the fix, on one line."""
from __future__ import annotations

from ..core.errors import OrbitError

# Where a person reads what to do when the ledger is damaged, lost or replaced.
RECOVERY_DOC = "docs/reliability.md, 'The ledger is never lost or replaced silently'"


class LedgerError(OrbitError):
    pass


class LedgerDamaged(LedgerError):
    """The ledger's file exists but is not a whole ledger: empty, cut short, not SQLite, or
    pages SQLite reports as malformed. Never re-created over, never written to by orbit."""


class LedgerIdentityError(LedgerError):
    """The ledger is not the one this home recorded: swapped, reset, or gone."""


def damaged(where: str, what: str) -> LedgerDamaged:
    err = LedgerDamaged(
        f"the ledger {where} is {what}; orbit left it as it is", field="ledger", value=where,
        fix="`orbit ledger check` names what the bundles and checkpoints on disk hold that no ledger does; then "
            f"restore a backup ({RECOVERY_DOC}) or run `orbit ledger repair` (it moves this file aside and "
            "re-registers what verifies)")
    err.what = what
    return err
