"""What only a PostgreSQL ledger needs: its database made on first use, and errors that say
which server could not be reached and how to fix it (never with the password)."""
from __future__ import annotations

import threading

import sqlalchemy as sa

from .errors import LedgerError

# SQLSTATEs: invalid_catalog_name (no such database), insufficient_privilege, duplicate_database.
NO_DATABASE, NO_PRIVILEGE, DUPLICATE_DATABASE = "3D000", "42501", "42P04"
_made: set[str] = set()
_lock = threading.Lock()


def _sqlstate(exc: BaseException) -> str | None:
    return getattr(getattr(exc, "orig", exc), "sqlstate", None)


def _shown(url: sa.URL) -> str:
    return url.render_as_string(hide_password=True)


def _connect(url: sa.URL):
    import psycopg  # lazy: 0.1-0.4 s; every CLI call imports this module (store.py), SQLite ledgers too

    return psycopg.connect(host=url.host, port=url.port or 5432, user=url.username, password=url.password,
                           dbname=url.database, autocommit=True, connect_timeout=10)


def ensure_database(url: str | sa.URL, *, field: str = "ORBIT_LEDGER_URL") -> bool:
    """Create the database `url` names when it does not exist yet (once per process).

    True if it was made now. The role needs CREATEDB for that; without it the error says
    which statement to ask a database administrator for.
    """
    import psycopg  # lazy: see _connect

    u = sa.engine.make_url(url) if isinstance(url, str) else url
    key = _shown(u)
    with _lock:
        if key in _made:
            return False
        try:
            _connect(u).close()
            _made.add(key)
            return False
        except psycopg.OperationalError as exc:
            if _sqlstate(exc) != NO_DATABASE and f'database "{u.database}" does not exist' not in str(exc):
                raise unreachable(u, exc, field) from None
        try:
            with _connect(u.set(database="postgres")) as con:
                con.execute(f'CREATE DATABASE "{_identifier(u.database, field)}"')
        except psycopg.Error as exc:
            if _sqlstate(exc) == DUPLICATE_DATABASE:  # another process made it meanwhile
                _made.add(key)
                return False
            if _sqlstate(exc) == NO_PRIVILEGE:
                raise LedgerError(f"database {u.database!r} does not exist on {u.host}:{u.port or 5432} and role "
                                  f"{u.username!r} may not create it", field=field, value=key,
                                  fix=f'ask a database administrator for: CREATE DATABASE "{u.database}" OWNER '
                                      f'"{u.username}"') from None
            raise unreachable(u, exc, field) from None
        _made.add(key)
        return True


def _identifier(name: str | None, field: str) -> str:
    if not name or '"' in name or "\x00" in name:
        raise LedgerError(f"{name!r} is not a database name orbit creates", field=field, value=name,
                          fix="use letters, digits and underscores")
    return name


def unreachable(url: str | sa.URL, exc: BaseException, field: str = "ORBIT_LEDGER_URL") -> LedgerError:
    """The one-line error for a PostgreSQL that refused or did not answer."""
    u = sa.engine.make_url(url) if isinstance(url, str) else url
    reason = " ".join(str(getattr(exc, "orig", exc)).split())[:300]
    return LedgerError(f"cannot reach the ledger's PostgreSQL at {u.host}:{u.port or 5432}: {reason}", field=field,
                       value=_shown(u),
                       fix="start PostgreSQL or correct the URL; the password comes from PGPASSWORD or ~/.pgpass")
