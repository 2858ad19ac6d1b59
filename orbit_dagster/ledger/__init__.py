"""The ledger: DuckDB-queryable, append-only, safe with many writer processes."""
from .store import Ledger, LedgerError, utcnow

__all__ = ["Ledger", "LedgerError", "utcnow"]
