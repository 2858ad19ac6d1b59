"""The ledger: a transactional store (SQLite or PostgreSQL) with DuckDB as its SQL face."""
from .store import Ledger, LedgerError, as_datetime, epoch, utcnow

__all__ = ["Ledger", "LedgerError", "as_datetime", "epoch", "utcnow"]
