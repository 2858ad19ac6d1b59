"""The SQL face's limits: how long a query may run, how much memory and disk it may use, how
long its text may be. Each comes from the settings (`Settings.sql_limits()` hands this module
the environment's text; `SqlLimits.parse`) or is given per call, and each refusal names the
limit, its value and the setting that changes it.

- `ORBIT_SQL_TIMEOUT_S` (default 60; `orbit sql --timeout`): DuckDB has no statement
  timeout, so a watchdog interrupts the connection at the limit, and again every 0.1 s
  until the query ends (one interrupt that lands before the query starts is lost); a
  query that does not stop within `KILL_GRACE_S` more has its process killed (the face's
  worker, `face._Worker`);
- `ORBIT_SQL_MEMORY` (default 1GiB, at most this machine's memory): DuckDB's
  `memory_limit`; a fetched result may take a quarter of it (rows are fetched in chunks and
  counted, so a huge result is refused before it is all in memory: the frame is joined,
  pickled and unpickled on its way out, so its copies add up to about the limit);
- `ORBIT_SQL_TEMP_SIZE` (default 4GiB): what a query may spill, under `<ledger>/tmp` (by
  default DuckDB spills into `.tmp` of the caller's working directory);
- `ORBIT_SQL_MAX_QUERY_CHARS` (default 65536): the SQL text itself.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..core.bounded import physical_memory, size_text
from ..core.errors import OrbitError

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MEMORY = "1GiB"
DEFAULT_TEMP = "4GiB"
DEFAULT_MAX_QUERY_CHARS = 65536
MAX_TIMEOUT_S = 7 * 86400.0
KILL_GRACE_S = 2.0  # after the interrupt, before the process is killed
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(b|bytes|kb|mb|gb|tb|kib|mib|gib|tib)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "bytes": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class SqlLimitExceeded(OrbitError):
    """A query ran past, or would go past, one of the SQL face's limits."""


def parse_size(text: str, *, field: str, minimum: int, maximum: int | None = None) -> int:
    m = _SIZE.match(text or "") if isinstance(text, str) and len(text) <= 64 else None
    fix = f"set {field} to a size such as 512MiB, 1GiB or 4GB"
    if m is None:
        raise OrbitError(f"{field}={text[:64]!r} is not a size", field=field, value=text, fix=fix)
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])
    if n < minimum:
        raise OrbitError(f"{field}={text.strip()} is less than {size_text(minimum)}", field=field, value=text, fix=fix)
    if maximum is not None and n > maximum:
        raise OrbitError(f"{field}={text.strip()} is more than this machine's memory ({size_text(maximum)})",
                         field=field, value=text, fix=f"set {field} to at most {size_text(maximum)}")
    return n


def parse_timeout(value: str | float, *, field: str) -> float:
    fix = f"set {field} to a number of seconds, e.g. 60 (at most {int(MAX_TIMEOUT_S)})"
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise OrbitError(f"{field}={str(value)[:64]!r} is not a number of seconds", field=field, value=value,
                         fix=fix) from None
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_TIMEOUT_S:
        raise OrbitError(f"{field}={value} is not a timeout in (0, {int(MAX_TIMEOUT_S)}] seconds", field=field,
                         value=value, fix=fix)
    return seconds


@dataclass(frozen=True)
class SqlLimits:
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: int = 1 << 30
    temp_bytes: int = 4 << 30
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS
    timeout_field: str = "ORBIT_SQL_TIMEOUT_S"  # what a person set the timeout with, for the message

    @classmethod
    def parse(cls, env: Mapping[str, str], *, timeout_s: float | None = None,
              memory: str | None = None) -> "SqlLimits":
        """The limits `env` (the settings' snapshot of ORBIT_SQL_*) sets; `timeout_s`/`memory`
        (a flag, an argument) win over it."""
        if timeout_s is not None:
            timeout, timeout_field = parse_timeout(timeout_s, field="--timeout"), "--timeout"
        else:
            timeout = parse_timeout(env.get("ORBIT_SQL_TIMEOUT_S") or DEFAULT_TIMEOUT_S, field="ORBIT_SQL_TIMEOUT_S")
            timeout_field = "ORBIT_SQL_TIMEOUT_S"
        mem = parse_size(memory or env.get("ORBIT_SQL_MEMORY") or DEFAULT_MEMORY, field="ORBIT_SQL_MEMORY",
                         minimum=16 << 20, maximum=physical_memory())
        temp = parse_size(env.get("ORBIT_SQL_TEMP_SIZE") or DEFAULT_TEMP, field="ORBIT_SQL_TEMP_SIZE", minimum=0)
        chars = env.get("ORBIT_SQL_MAX_QUERY_CHARS") or str(DEFAULT_MAX_QUERY_CHARS)
        if not chars.isdigit() or not 1 <= int(chars) <= 1 << 24:
            raise OrbitError(f"ORBIT_SQL_MAX_QUERY_CHARS={chars[:64]!r} is not a count of characters",
                             field="ORBIT_SQL_MAX_QUERY_CHARS", value=chars, fix="set it to e.g. 65536")
        return cls(timeout, mem, temp, int(chars), timeout_field)

    @property
    def result_bytes(self) -> int:
        return self.memory_bytes // 4

    @property
    def connection_key(self) -> tuple[int, int]:
        """What a connection is made with (the rest applies per query)."""
        return self.memory_bytes, self.temp_bytes

    def settings_sql(self, temp_dir: Path) -> list[str]:
        """DuckDB settings, run before the connection locks its configuration."""
        quoted = str(temp_dir).replace("'", "''")
        return [f"SET memory_limit = '{self.memory_bytes}B'", f"SET temp_directory = '{quoted}'",
                f"SET max_temp_directory_size = '{self.temp_bytes}B'"]

    # ---- the refusals -------------------------------------------------------------------
    def timed_out(self) -> SqlLimitExceeded:
        how = "--timeout SECONDS" if self.timeout_field == "--timeout" else "orbit sql --timeout SECONDS or ORBIT_SQL_TIMEOUT_S"
        return SqlLimitExceeded(
            f"the query was stopped at the SQL face's timeout of {self.timeout_s:g} s ({self.timeout_field})",
            field=self.timeout_field, value=self.timeout_s,
            fix=f"narrow the query (a WHERE, a LIMIT, an aggregate), or give it longer: {how}")

    def out_of_memory(self) -> SqlLimitExceeded:
        return SqlLimitExceeded(
            f"the query needs more memory than the SQL face's limit of {size_text(self.memory_bytes)} (ORBIT_SQL_MEMORY)",
            field="ORBIT_SQL_MEMORY", value=self.memory_bytes,
            fix="narrow the query (filter or aggregate before collecting lists), or raise the limit, e.g. "
                "ORBIT_SQL_MEMORY=4GiB")

    def result_too_large(self, fetched: int) -> SqlLimitExceeded:
        return SqlLimitExceeded(
            f"the result is larger than the SQL face's limit of {size_text(self.result_bytes)} (a quarter of "
            f"ORBIT_SQL_MEMORY={size_text(self.memory_bytes)}); {size_text(fetched)} fetched when it was stopped",
            field="ORBIT_SQL_MEMORY", value=self.memory_bytes,
            fix="select fewer rows or columns (a LIMIT, an aggregate), or raise ORBIT_SQL_MEMORY")

    def spill_too_large(self, temp_dir: Path) -> SqlLimitExceeded:
        return SqlLimitExceeded(
            f"the query would spill more than {size_text(self.temp_bytes)} to {temp_dir} (ORBIT_SQL_TEMP_SIZE)",
            field="ORBIT_SQL_TEMP_SIZE", value=self.temp_bytes,
            fix="narrow the query, or raise ORBIT_SQL_TEMP_SIZE (e.g. 16GiB) on a disk with that much free")

    def query_too_long(self, chars: int) -> SqlLimitExceeded:
        return SqlLimitExceeded(
            f"the query is {chars} characters long, more than the SQL face's limit of {self.max_query_chars} "
            "(ORBIT_SQL_MAX_QUERY_CHARS)", field="ORBIT_SQL_MAX_QUERY_CHARS", value=chars,
            fix="shorten it (a view or a join instead of a long IN list), or raise ORBIT_SQL_MAX_QUERY_CHARS")
