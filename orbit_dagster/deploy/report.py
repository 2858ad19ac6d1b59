"""What `orbit profile` (and the first line of `orbit ui` / `orbit daemon`) says about a deployment:
read from the `dagster.yaml` actually in place, which may differ from what the profile would write."""
from __future__ import annotations

from typing import Any

import yaml

from ..control.capacity import limits_from_tags
from ..settings import Settings
from .instance import code_location_source, daemon_heartbeats, ensure_dagster_home, profile
from .profiles import render_dagster_yaml


def _storage(cfg: dict) -> str:
    storage = cfg.get("storage") or {}
    if "postgres" in storage:
        db = storage["postgres"].get("postgres_db") or {}
        if db:
            return f"PostgreSQL {db.get('username')}@{db.get('hostname')}:{db.get('port', 5432)}/{db.get('db_name')}"
        return "PostgreSQL (postgres_url)"
    if storage:
        return f"{next(iter(storage))} (see dagster.yaml)"
    return "SQLite files in the Dagster home"


def _pools(cfg: dict) -> dict[str, dict[str, int]]:
    runs = ((cfg.get("concurrency") or {}).get("runs") or {})
    limits = runs.get("tag_concurrency_limits") or ((cfg.get("run_coordinator") or {}).get("config") or {}).get(
        "tag_concurrency_limits") or []
    pools, trains = limits_from_tags(limits)
    out: dict[str, dict[str, int]] = {name: {"limit": limit} for name, limit in pools.items()}
    for name, limit in trains.items():
        out.setdefault(name, {})["trainings"] = limit
    return out


def headline(settings: Settings) -> str:
    """One line: the profile, its Dagster home and where the state lives."""
    prof = profile(settings)
    home = ensure_dagster_home(settings)
    cfg = yaml.safe_load((home / "dagster.yaml").read_text()) or {}
    return (f"profile {prof.name}; Dagster home {home} (storage: {_storage(cfg)}); "
            f"ledger {settings.ledger().display}")


def describe(settings: Settings) -> dict[str, Any]:
    prof = profile(settings)
    cfg_path = settings.home / prof.dagster_dir / "dagster.yaml"
    existed = cfg_path.exists()
    home = ensure_dagster_home(settings)
    text = cfg_path.read_text()
    cfg = yaml.safe_load(text) or {}
    if not existed:
        state = "written now for this profile"
    elif text == render_dagster_yaml(prof):
        state = "as orbit writes it for this profile"
    else:
        state = ("differs from what this profile would write now (an edit, an older orbit, or other settings); "
                 "orbit leaves it as it is: `orbit profile --config` prints the current one")
    notes = []
    storage = _storage(cfg)
    if prof.postgres is not None and f"/{prof.postgres.dagster_database}" not in storage:
        notes.append(f"ORBIT_POSTGRES_URL names {prof.postgres.host}:{prof.postgres.port}, but dagster.yaml's "
                     f"storage is {storage}")
    ledger = settings.ledger()
    try:
        beats = daemon_heartbeats(settings)
    except Exception as exc:  # the report still says the rest
        beats, notes = {}, notes + [f"could not read daemon heartbeats: {type(exc).__name__}"]
    launcher = (cfg.get("run_launcher") or {}).get("class")
    if launcher != "OrbitRunLauncher":
        notes.append(f"dagster.yaml's run launcher ({launcher or 'Dagster default'}) has no health checks, so run "
                     "monitoring cannot fail a run whose worker died; the interruption sensor does it instead. "
                     "Add the run_launcher block `orbit profile --config` shows")
    runs = (cfg.get("concurrency") or {}).get("runs") or {}
    retries = cfg.get("run_retries") or {}
    return {
        "profile": prof.name,
        "selected_by": "ORBIT_PROFILE" if settings.profile.chosen else "default",
        "orbit_home": str(settings.home),
        "dagster_home": str(home),
        "dagster_yaml": str(cfg_path),
        "dagster_yaml_state": state,
        "dagster_storage": storage,
        "ledger": ledger.display,
        "ledger_kind": ledger.dialect,
        "code_location": code_location_source(settings),
        "max_concurrent_runs": runs.get("max_concurrent_runs"),
        "pools": _pools(cfg),
        "run_retries": int(retries.get("max_retries", 0)) if retries.get("enabled") else 0,
        "follow": settings.follow,
        "run_monitoring": bool((cfg.get("run_monitoring") or {}).get("enabled")),
        "run_health_checks": launcher == "OrbitRunLauncher",
        "daemon_heartbeats_s": {k: round(v, 1) for k, v in sorted(beats.items())},
        "notes": notes,
    }


def format_report(r: dict[str, Any]) -> str:
    alive = [k for k, age in r["daemon_heartbeats_s"].items() if age < 30]
    pools = ", ".join(f"{name} {p.get('limit', '-')} (trainings {p.get('trainings', p.get('limit', '-'))})"
                      for name, p in r["pools"].items()) or "none"
    lines = [
        f"profile:        {r['profile']} (selected by {r['selected_by']}; switch with ORBIT_PROFILE=embedded|team)",
        f"dagster home:   {r['dagster_home']}",
        f"dagster.yaml:   {r['dagster_yaml_state']}",
        f"dagster store:  {r['dagster_storage']}",
        f"ledger:         {r['ledger']} ({r['ledger_kind']})",
        f"code location:  {r['code_location']}",
        f"runs at once:   {r['max_concurrent_runs']}; pools: {pools}",
        f"run retries:    {r['run_retries'] or 'off'}; run monitoring: {'on' if r['run_monitoring'] else 'off'}"
        + ("; dead run workers detected (orbit's run launcher)" if r.get("run_health_checks") else ""),
        "trainings:      " + ("followed by the daemon between short runs (ORBIT_FOLLOW=daemon)"
                               if r["follow"] == "daemon" else "each followed by its run (ORBIT_FOLLOW=run)"),
        f"daemon:         {'running (' + ', '.join(alive) + ')' if alive else 'not running (orbit daemon / orbit ui)'}",
    ]
    lines += [f"note:           {n}" for n in r["notes"]]
    return "\n".join(lines)

