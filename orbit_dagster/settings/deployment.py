"""The deployment's settings, parsed: the profile (`ORBIT_PROFILE`, `ORBIT_POOLS`,
`ORBIT_POSTGRES_URL`), who follows an attempt (`ORBIT_FOLLOW`) and the code server
(`ORBIT_CODE_SERVER`). Only parsing lives here, on values the settings module hands in: what a
profile means for Dagster (its `dagster.yaml`, the pools' run tags) is `deploy/profiles.py`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import get_args

import sqlalchemy as sa

from ..core.errors import OrbitError
from ..core.execution import Placement

PROFILES = ("embedded", "team")
PLACEMENTS: tuple[str, ...] = get_args(Placement)
# Concurrent instances per provider when ORBIT_POOLS does not say: the sim market is a few
# processes on this machine; an SSH inventory's size and an EC2 account's spot quota are
# the operator's to give (docs/deploy.md).
DEFAULT_POOLS = {"sim": 4, "ssh_rental": 2, "aws_spot": 4}
# Runs that rent nothing (best checkpoint, cost summary, offer discovery) always find a slot.
CONTROL_SLOTS = 2
FOLLOW_MODES = ("run", "daemon")


@dataclass(frozen=True)
class Pool:
    """One provider's concurrent runs (trainings and evaluations that rent from it)."""

    name: str
    limit: int

    @property
    def eval_reserve(self) -> int:
        """Slots trainings leave to evaluations: a quarter, at least one (none in a pool of one)."""
        return 0 if self.limit < 2 else max(1, self.limit // 4)

    @property
    def train_limit(self) -> int:
        return self.limit - self.eval_reserve


def pool_setting(text: str | None) -> dict[str, int]:
    """`ORBIT_POOLS="sim=4 aws_spot=8"` as {provider: limit}; a bad entry names itself and the fix."""
    limits: dict[str, int] = {}
    fix = f"write NAME=LIMIT pairs, NAME one of {', '.join(PLACEMENTS)}, LIMIT a whole number >= 1, e.g. sim=4 aws_spot=8"
    for item in (text or "").replace(",", " ").split():
        name, sep, value = item.partition("=")
        if not sep or name not in PLACEMENTS:
            raise OrbitError(f"ORBIT_POOLS entry {item!r} does not name a provider", field="ORBIT_POOLS", value=text,
                             fix=fix)
        if not value.isdigit() or int(value) < 1:
            raise OrbitError(f"ORBIT_POOLS entry {item!r}: the limit must be a whole number >= 1",
                             field="ORBIT_POOLS", value=text, fix=fix)
        limits[name] = int(value)
    return limits


def pools_over(limits: dict[str, int], defaults: dict[str, int] | None = None) -> tuple[Pool, ...]:
    merged = {**(defaults or DEFAULT_POOLS), **limits}
    return tuple(Pool(name, merged[name]) for name in PLACEMENTS if name in merged)


def parse_pools(text: str | None, defaults: dict[str, int] | None = None) -> tuple[Pool, ...]:
    """`ORBIT_POOLS` over the defaults."""
    return pools_over(pool_setting(text), defaults)


@dataclass(frozen=True)
class PostgresServer:
    """The team's PostgreSQL: `postgresql://USER@HOST:PORT/DB`. No password in the URL: libpq
    reads it from PGPASSWORD or ~/.pgpass, so it is never written into a file orbit makes."""

    user: str
    host: str
    port: int
    database: str

    @classmethod
    def parse(cls, url: str | None, field: str = "ORBIT_POSTGRES_URL") -> "PostgresServer":
        fix = "set ORBIT_POSTGRES_URL=postgresql://USER@HOST:PORT/DB (the password in PGPASSWORD or ~/.pgpass)"
        if not url:
            raise OrbitError("the team profile needs a PostgreSQL server", field=field, value=url, fix=fix)
        try:
            u = sa.engine.make_url(url)
        except Exception:  # sqlalchemy's ArgumentError, or a ValueError from a bad port
            raise OrbitError(f"{field} is not a database URL", field=field, value=url, fix=fix) from None
        if u.get_backend_name() != "postgresql" or not u.host or not u.username:
            raise OrbitError(f"{field} must name a PostgreSQL server with a user and a host", field=field,
                             value=u.render_as_string(hide_password=True), fix=fix)
        if u.password:
            raise OrbitError(f"{field} holds a password; orbit writes this URL into dagster.yaml and logs",
                             field=field, value=u.render_as_string(hide_password=True),
                             fix="drop it from the URL and export PGPASSWORD (or use ~/.pgpass)")
        return cls(u.username, u.host, int(u.port or 5432), u.database or "orbit")

    @property
    def dagster_database(self) -> str:
        return f"{self.database}_dagster"

    def url(self, database: str | None = None, driver: str = "psycopg") -> str:
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{self.user}@{self.host}:{self.port}/{database or self.database}"

    @property
    def ledger_url(self) -> str:
        return self.url()


@dataclass(frozen=True)
class Profile:
    """The deployment profile: `embedded` (SQLite, one machine) or `team` (PostgreSQL)."""

    name: str
    pools: tuple[Pool, ...]
    postgres: PostgresServer | None = None
    # What ORBIT_POOLS set, kept so the pools can be laid over other defaults (the SSH
    # inventory's GPU count: deploy/instance.py).
    pool_limits: tuple[tuple[str, int], ...] = ()
    # Whether ORBIT_PROFILE chose it (`orbit profile` says so).
    chosen: bool = False

    @classmethod
    def parse(cls, name: str | None, pools: str | None, postgres_url: str | None) -> "Profile":
        chosen = bool(name)
        name = name or "embedded"
        if name not in PROFILES:
            raise OrbitError(f"unknown deployment profile {name!r}", field="ORBIT_PROFILE", value=name,
                             fix="ORBIT_PROFILE=embedded (SQLite, the default) or ORBIT_PROFILE=team (PostgreSQL)")
        limits = pool_setting(pools)
        pg = PostgresServer.parse(postgres_url) if name == "team" else None
        return cls(name, pools_over(limits), pg, tuple(sorted(limits.items())), chosen)

    def with_pool_defaults(self, defaults: dict[str, int]) -> "Profile":
        """The same profile with ORBIT_POOLS laid over `defaults` instead of DEFAULT_POOLS."""
        return replace(self, pools=pools_over(dict(self.pool_limits), defaults))

    @property
    def dagster_dir(self) -> str:
        """The Dagster home's name under $ORBIT_HOME: one per profile, so each keeps its dagster.yaml."""
        return "dagster" if self.name == "embedded" else f"dagster-{self.name}"

    @property
    def max_concurrent_runs(self) -> int:
        return sum(p.limit for p in self.pools) + CONTROL_SLOTS

    @property
    def ledger_url(self) -> str | None:
        """The profile's ledger; None means the default SQLite file under $ORBIT_HOME."""
        return self.postgres.ledger_url if self.postgres else None


def parse_follow(text: str | None, profile: str) -> str:
    """Who follows a launched training attempt (`ORBIT_FOLLOW`): `run`, its training run for the
    whole attempt (the embedded default: the UI's Terminate stops the attempt), or `daemon`,
    where the training run launches the attempt and hands following to the daemon
    (control/handoff.py; the team default: no run slot or run worker is held while a GPU trains)."""
    mode = text or ("daemon" if profile == "team" else "run")
    if mode not in FOLLOW_MODES:
        raise OrbitError(f"unknown follow mode {mode!r}", field="ORBIT_FOLLOW", value=mode,
                         fix="ORBIT_FOLLOW=run (a run follows each attempt) or ORBIT_FOLLOW=daemon (hand-off)")
    return mode


SOCKET_NAME = "code-server.sock"
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


def socket_path_ok(path: str, field: str) -> str:
    if len(path.encode()) > UNIX_PATH_MAX:
        raise OrbitError(f"the socket path is {len(path.encode())} bytes, more than a unix socket's "
                         f"{UNIX_PATH_MAX}", field=field, value=path,
                         fix="choose a shorter path (e.g. under /run or /tmp), or HOST:PORT")
    return path


@dataclass(frozen=True)
class CodeServerAddress:
    """Where a code server listens: a unix socket, or a host and port (`ORBIT_CODE_SERVER`)."""

    socket: str | None = None
    host: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str, field: str = "ORBIT_CODE_SERVER") -> "CodeServerAddress":
        fix = f"{field}=unix:/path/to/{SOCKET_NAME} or {field}=127.0.0.1:4000"
        text = (text or "").strip()
        if text.startswith("unix:") or text.startswith("/"):
            path = text[5:] if text.startswith("unix:") else text
            if not path.startswith("/"):
                raise OrbitError(f"{field} names a socket by a relative path", field=field, value=text, fix=fix)
            return cls(socket=socket_path_ok(path, field))
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise OrbitError(f"{field} is neither a unix socket nor HOST:PORT", field=field, value=text, fix=fix)
        return cls(host=host.strip("[]"), port=int(port))

    def __str__(self) -> str:
        return f"unix:{self.socket}" if self.socket else f"{self.host}:{self.port}"

    @property
    def grpc_target(self) -> str:
        return str(self)

    def server_options(self) -> list[str]:
        return ["--socket", self.socket] if self.socket else ["--host", str(self.host), "--port", str(self.port)]

    def workspace_yaml(self) -> str:
        where = [f"      socket: {self.socket}"] if self.socket else [f"      host: {self.host}",
                                                                     f"      port: {self.port}"]
        return "\n".join([
            "# Written by orbit: the code server this webserver or daemon uses (see docs/deploy.md).",
            "# The location keeps the name `-m orbit_dagster.definitions` gave it, so sensor state and",
            "# run history carry over.",
            "load_from:",
            "  - grpc_server:",
            *where,
            "      location_name: orbit_dagster.definitions",
        ]) + "\n"
