"""Where everything lives: one home directory, `$ORBIT_HOME` (default `./.orbit`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..ledger import Ledger


@dataclass(frozen=True)
class Settings:
    home: Path
    # The sim market: seconds of notice before a reclaim, and which reclaim schedule.
    sim_notice_seconds: float = 120.0
    sim_reclaims: str = "none"

    @classmethod
    def from_env(cls, home: str | Path | None = None) -> "Settings":
        root = Path(home or os.environ.get("ORBIT_HOME") or ".orbit").expanduser().resolve()
        return cls(
            home=root,
            sim_notice_seconds=float(os.environ.get("ORBIT_SIM_NOTICE_SECONDS", 120)),
            sim_reclaims=os.environ.get("ORBIT_SIM_RECLAIMS", "none"),
        )

    @property
    def ledger_dir(self) -> Path:
        return self.home / "ledger"

    @property
    def bundles_dir(self) -> Path:
        return self.home / "bundles"

    @property
    def artifacts_dir(self) -> Path:
        return self.home / "artifacts"

    @property
    def sim_dir(self) -> Path:
        return self.home / "sim"

    @property
    def store_uri(self) -> str:
        return os.environ.get("ORBIT_CHECKPOINT_STORE") or (self.home / "checkpoints").as_uri()

    def ledger(self) -> Ledger:
        return Ledger(self.ledger_dir).init()
