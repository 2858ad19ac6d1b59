"""The ledger: a transactional store (SQLite or PostgreSQL) with DuckDB as its SQL face."""
from .errors import LedgerDamaged, LedgerError, LedgerIdentityError
from .store import Ledger, as_datetime, epoch, utcnow

__all__ = ["Ledger", "LedgerError", "LedgerDamaged", "LedgerIdentityError", "as_datetime", "epoch", "utcnow"]
