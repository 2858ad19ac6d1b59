"""Ledger tables, their keys and indexes, and the views people and the code read.

The ledger is a transactional database (SQLite in WAL mode by default, PostgreSQL for a
team), defined once here with SQLAlchemy so both get the same tables. Conventions:

- every time is a float of seconds since the epoch, UTC (`*_at`, `ts`): the same type and the
  same arithmetic on SQLite, PostgreSQL and DuckDB; `to_timestamp(x)` shows it as a time;
- current state lives on the row it describes (`jobs.state`, `runs.state`,
  `instances.stopped_at`, `checkpoints.deleted_at`, `evaluations.state`), updated in the same
  transaction that appends its history (`job_states`, `run_states`, `events`), so the
  control plane's questions ("which jobs are queued?") are index lookups whose cost does
  not grow with history;
- a retried write never makes a duplicate: each table says what a repeated key does
  (`ignore`: facts that never change, e.g. a checkpoint; `update`: settings a person may
  change, e.g. a primary metric; `append`: rows with a generated id).
Changing anything here needs a new migration in `migrations.py`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import sqlalchemy as sa

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER keys only
T = sa.Text
F = sa.Double
I = sa.BigInteger  # noqa: E741 - one letter per column type keeps the tables readable


def col(name: str, type_=T, **kw) -> sa.Column:
    return sa.Column(name, type_, **kw)


metadata = sa.MetaData()


@dataclass(frozen=True)
class TableSpec:
    table: sa.Table
    key: tuple[str, ...]
    on_conflict: str  # ignore | update | append

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def columns(self) -> list[str]:
        return [c.name for c in self.table.columns]


# PostgreSQL cuts identifiers at 63 bytes and refuses longer ones in DDL; SQLite takes any.
MAX_IDENTIFIER = 63


def index_name(table: str, cols: tuple[str, ...]) -> str:
    """`ix_<table>_<columns>`, or its first 54 characters and a digest of the whole when longer
    than PostgreSQL allows (the same name on both databases)."""
    name = f"ix_{table}_{'_'.join(cols)}"
    if len(name) <= MAX_IDENTIFIER:
        return name
    return f"{name[:MAX_IDENTIFIER - 9]}_{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def _table(name: str, *columns: sa.Column, key: tuple[str, ...], on_conflict: str = "ignore",
           indexes: tuple[tuple[str, ...], ...] = ()) -> TableSpec:
    table = sa.Table(name, metadata, *columns, *(sa.Index(index_name(name, cols), *cols) for cols in indexes))
    if on_conflict != "append":
        table.append_constraint(sa.UniqueConstraint(*key, name=f"uq_{name}_key"))
    return TableSpec(table, key, on_conflict)


TABLES: dict[str, TableSpec] = {t.name: t for t in [
    _table("projects", col("project", primary_key=True), col("primary_metric"), col("primary_mode"),
           col("created_at", F), col("updated_at", F), key=("project",), on_conflict="ignore"),
    _table("experiments", col("experiment", primary_key=True), col("project"),
           col("primary_metric"), col("primary_mode"),  # set by a person; wins over the project's
           col("template_metric"), col("template_mode"),  # from the first job's template; the fallback
           col("created_at", F), col("updated_at", F), key=("experiment",), on_conflict="ignore",
           indexes=(("project",),)),
    _table("jobs", col("job_id", primary_key=True), col("template"), col("template_version", I), col("kind"),
           col("experiment"), col("project"), col("placement"), col("max_interruptions", I),
           col("imported", I, server_default="0"), col("created_at", F),
           # the current state, its attempt and the lineage that attempt trains
           col("state"), col("attempt", I), col("lineage"), col("reason"), col("failure_class"), col("detail"),
           col("state_at", F), col("deadline_at", F),
           key=("job_id",), indexes=(("state",), ("experiment",))),
    _table("job_states", col("id", ID, primary_key=True, autoincrement=True), col("job_id"), col("attempt", I),
           col("state"), col("reason"), col("failure_class"), col("detail"), col("ts", F),
           key=("id",), on_conflict="append", indexes=(("job_id", "attempt"), ("state", "failure_class"))),
    _table("bundles", col("job_id"), col("attempt", I), col("bundle_hash"), col("path"), col("template_id"),
           col("provenance"), col("created_at", F),
           sa.PrimaryKeyConstraint("job_id", "attempt"), key=("job_id", "attempt")),
    _table("runs", col("run_id", primary_key=True), col("job_id"), col("attempt", I), col("lineage"),
           col("bundle_hash"), col("dagster_run_id"), col("instance_id"), col("provider"), col("offer_id"),
           col("resume_from"), col("handle"), col("imported", I, server_default="0"), col("experiment"),
           col("project"), col("started_at", F),
           col("state"), col("exit_code", I), col("failure_class"), col("reason"), col("state_at", F),
           # Hand-off (control/handoff.py): when the last run following the attempt handed it to
           # the daemon, and where the next run takes up its event stream.
           col("handed_off_at", F), col("follow_offset", I), col("follow_step", I), col("follow_progress_at", F),
           key=("run_id",), indexes=(("job_id", "attempt"), ("state",), ("offer_id", "state"),
                                       ("instance_id",))),  # runs of an instance: reclaim counts, notices
    _table("run_states", col("id", ID, primary_key=True, autoincrement=True), col("run_id"), col("state"),
           col("exit_code", I), col("failure_class"), col("reason"), col("ts", F),
           key=("id",), on_conflict="append", indexes=(("run_id",),)),
    _table("instances", col("instance_id", primary_key=True), col("provider"), col("offer_id"),
           col("instance_type"), col("gpu"), col("gpu_count", I), col("region"), col("zone"),
           col("usd_per_second", F), col("spot", I), col("purpose"), col("job_id"), col("run_id"),
           col("checkpoint_key"), col("suite"), col("gpu_slots"), col("handle"), col("dagster_run_id"),
           col("started_at", F), col("stopped_at", F), col("stop_reason"), col("billed_usd", F),
           key=("instance_id",), indexes=(("job_id",), ("stopped_at",), ("offer_id",), ("run_id",))),
    _table("checkpoints", col("checkpoint_key", primary_key=True), col("job_id"), col("experiment"),
           col("run_id"), col("attempt", I), col("lineage"), col("step", I), col("tier"), col("parent_key"),
           col("uri"), col("sha256"), col("bytes", I), col("weights_sha256"), col("train_loss", F),
           col("save_seconds", F), col("created_at", F), col("registered_at", F),
           col("deleted_at", F), col("deleted_reason"),
           # When training went on past the step (an async save or an upload becomes durable
           # later): where a lost attempt's wasted work begins (core/costs.py). NULL: not
           # reported. Last, as migration 10 adds it to an older ledger.
           col("trained_at", F),
           key=("checkpoint_key",),
           indexes=(("job_id", "step"), ("lineage", "step"), ("experiment",), ("registered_at",), ("uri",))),
    # One row per (checkpoint, suite): the request and, once done, its result. `state` is
    # PENDING -> RUNNING -> SUCCEEDED | FAILED (| SKIPPED when the checkpoint is gone).
    _table("evaluations", col("checkpoint_key"), col("suite"), col("job_id"), col("experiment"), col("state"),
           col("tries", I, server_default="0"), col("metrics"), col("instance_id"), col("dagster_run_id"),
           col("seconds", F), col("reason"), col("requested_at", F), col("started_at", F), col("finished_at", F),
           sa.PrimaryKeyConstraint("checkpoint_key", "suite"), key=("checkpoint_key", "suite"),
           # (state, finished_at): "finished since the cursor" without reading every finished row
           indexes=(("state", "finished_at"), ("job_id",), ("experiment", "state"), ("finished_at",))),
    _table("metric_points", col("id", ID, primary_key=True, autoincrement=True), col("job_id"), col("experiment"),
           col("run_id"), col("checkpoint_key"), col("suite"), col("step", I), col("name"), col("value", F),
           col("source"), col("ts", F),
           key=("run_id", "source", "name", "step"),  # a re-read event (after a re-attach) adds nothing
           on_conflict="ignore",
           indexes=(("job_id", "name", "step"), ("experiment", "source", "name", "value"),
                    ("checkpoint_key", "source", "name", "ts"))),  # a checkpoint's latest value of a metric
    _table("events", col("event_id", primary_key=True), col("ts", F), col("kind"), col("job_id"), col("run_id"),
           col("instance_id"), col("checkpoint_key"), col("detail"),
           key=("event_id",), indexes=(("kind", "job_id"), ("run_id", "kind"), ("instance_id", "kind"),
                                       ("job_id", "ts"))),
    _table("price_ticks", col("offer_id"), col("ts", F), col("usd_per_hour_spot", F),
           col("usd_per_hour_on_demand", F), col("source"),
           sa.PrimaryKeyConstraint("offer_id", "ts"), key=("offer_id", "ts")),
    # The bill of one instance, split into lines that sum to it: `train` (attributed to the
    # checkpoint it led to), `wasted` (work after the last checkpoint of a lost attempt),
    # `overhead` (boot, waiting, shutdown), `eval` (attributed to the evaluated checkpoint).
    _table("costs", col("cost_id", primary_key=True), col("instance_id"), col("job_id"), col("run_id"),
           col("attempt", I), col("checkpoint_key"), col("suite"), col("kind"), col("start_at", F),
           col("end_at", F), col("seconds", F), col("gpu_count", I), col("usd_per_second", F), col("usd", F),
           key=("cost_id",), indexes=(("job_id",), ("instance_id",), ("checkpoint_key",))),
    # Derived, kept in step by the transaction that writes their facts (rollups.py): the cost
    # views and `orbit best` read these instead of aggregating history on every call.
    _table("cost_lines", col("job_id"), col("line"), col("checkpoint_key"), col("experiment"), col("train_usd", F),
           col("eval_usd", F), col("wasted_usd", F), col("overhead_usd", F), col("usd", F), col("seconds", F),
           sa.PrimaryKeyConstraint("job_id", "line"), key=("job_id", "line"), indexes=(("experiment",),)),
    _table("cost_jobs", col("job_id", primary_key=True), col("experiment"), col("project"), col("train_usd", F),
           col("eval_usd", F), col("wasted_usd", F), col("overhead_usd", F), col("usd", F),
           col("instance_seconds", F), col("wasted_gpu_seconds", F), col("attempts", I),
           key=("job_id",), indexes=(("experiment",),)),
    # With the checkpoint's lineage (a fact of the checkpoint) and whether retention deleted it
    # (set in the same transaction), so ranking and counting an experiment's candidates reads
    # this table's index alone, in metric order.
    _table("eval_latest", col("checkpoint_key"), col("name"), col("experiment"), col("job_id"), col("lineage"),
           col("deleted", I), col("value", F), col("ts", F), col("point_id", I),
           sa.PrimaryKeyConstraint("checkpoint_key", "name"), key=("checkpoint_key", "name"),
           indexes=(("experiment", "name", "deleted", "value", "lineage", "job_id", "checkpoint_key"),)),
    _table("best_checkpoints", col("experiment"), col("computed_at", F), col("checkpoint_key"), col("metric_name"),
           col("metric_mode"), col("metric_value", F), col("metric_source"), col("resolved_from"),
           col("candidates", I), col("evaluations", I),
           sa.PrimaryKeyConstraint("experiment", "computed_at"), key=("experiment", "computed_at")),
    # Each Dagster run worker's liveness (control/liveness.py): which process on which machine
    # (and boot) does the run's work, its last heartbeat, and when it left. A run is followed
    # only while its worker lives.
    _table("run_workers", col("dagster_run_id", primary_key=True), col("host"), col("boot"), col("pid", I),
           col("pid_start", I), col("started_at", F), col("heartbeat_at", F), col("ended_at", F),
           key=("dagster_run_id",), on_conflict="update"),
    # The nodes of a multi-node attempt (resources.nodes > 1): which instance is which node rank
    # of the group that runs the attempt (node 0 hosts the rendezvous). A node kept after a reclaim
    # of another joins the next attempt's group under its new rank (control/group_recovery.py).
    _table("group_members", col("run_id"), col("node_rank", I), col("job_id"), col("attempt", I),
           col("instance_id"), col("offer_id"), col("joined_at", F),
           sa.PrimaryKeyConstraint("run_id", "node_rank"), key=("run_id", "node_rank"), on_conflict="update",
           indexes=(("instance_id",), ("job_id",))),
    _table("decisions", col("decision_id", primary_key=True), col("job_id"), col("attempt", I), col("kind"),
           col("chosen"), col("runner_up"), col("inputs"), col("ts", F),
           key=("decision_id",), indexes=(("job_id", "kind"),)),
    # Offer discovery (control/discovery.py): each refresh asks each source (a provider, or the
    # shipped price catalog) for its shapes; a source that failed keeps its previous offers.
    _table("catalog_refreshes", col("refresh_id"), col("source"), col("ts", F), col("status"), col("offers", I),
           col("error"), sa.PrimaryKeyConstraint("refresh_id", "source"), key=("refresh_id", "source"),
           indexes=(("ts",),)),
    # What changed since the previous refresh: type_added/removed, offer_added/removed, price_changed.
    _table("catalog_changes", col("change_id", primary_key=True), col("refresh_id"), col("ts", F), col("source"),
           col("kind"), col("provider"), col("offer_id"), col("instance_type"), col("gpu"), col("region"),
           col("zone"), col("market"), col("old_usd_per_gpu_hour", F), col("new_usd_per_gpu_hour", F),
           col("change_pct", F), key=("change_id",), indexes=(("offer_id", "ts"), ("refresh_id",), ("kind", "ts"))),
]}

# Deleted checkpoints (a few, however long the history): the evaluations still pending on
# them are skipped every tick. Partial, so SQLite uses it for `deleted_at IS NOT NULL` (a
# plain index it does not) and live checkpoints cost it nothing.
sa.Index("ix_checkpoints_deleted", TABLES["checkpoints"].table.c.deleted_at,
         sqlite_where=TABLES["checkpoints"].table.c.deleted_at.isnot(None),
         postgresql_where=TABLES["checkpoints"].table.c.deleted_at.isnot(None))

# Portable SQL (SQLite, PostgreSQL and DuckDB parse it alike): `{now}` is the dialect's
# "seconds since the epoch, now". The control plane, `orbit sql` and `duckdb` see the same
# names. Cost views are built from `costs`, whose lines sum to each instance's bill, so
# every cost view sums to the bill too; money is never NULL (never NaN in pandas).
VIEWS: dict[str, str] = {
    "live_checkpoints": "SELECT * FROM checkpoints WHERE deleted_at IS NULL",
    "instance_usage": """
        SELECT i.*, coalesce(i.stopped_at, {now}) - i.started_at AS seconds,
               (coalesce(i.stopped_at, {now}) - i.started_at) * i.usd_per_second AS usd,
               CASE WHEN i.stopped_at IS NULL THEN 1 ELSE 0 END AS running
        FROM instances i""",
    # The cost views read the totals `rollups.py` keeps per job and per line (same sums as
    # grouping `costs`, without reading every cost line on each call).
    # `eval_per_train`: what evaluating a job cost per dollar of its training (NULL for a job
    # with no training bill, an imported run): above 1, its evaluations cost more than it.
    "cost_by_job": """
        SELECT job_id, experiment, project, usd, train_usd, eval_usd,
               CASE WHEN train_usd > 0 THEN eval_usd / train_usd END AS eval_per_train,
               wasted_usd, overhead_usd, instance_seconds, wasted_gpu_seconds, attempts
        FROM cost_jobs""",
    "cost_by_experiment": """
        SELECT experiment, project, sum(usd) AS usd, sum(train_usd) AS train_usd, sum(eval_usd) AS eval_usd,
               sum(wasted_usd) AS wasted_usd, sum(overhead_usd) AS overhead_usd,
               sum(wasted_gpu_seconds) AS wasted_gpu_seconds, count(*) AS jobs
        FROM cost_jobs GROUP BY experiment, project""",
    # One line per checkpoint (its training and its evaluations), and per job one line for
    # each of wasted and overhead: the lines sum to the bill.
    "cost_by_checkpoint": """
        SELECT job_id, line, checkpoint_key, train_usd, eval_usd, wasted_usd, overhead_usd, usd, seconds, experiment
        FROM cost_lines""",
    # Each node's share of a training bill: its instance-seconds and dollars per attempt, and
    # what of them was wasted when the group was stopped (a node of a single-instance job is
    # node 0). Sums to the bill of the training instances it covers.
    "cost_by_node": """
        SELECT c.job_id, c.attempt, coalesce(g.node_rank, 0) AS node_rank, c.instance_id, i.offer_id,
               coalesce(sum(c.seconds), 0) AS instance_seconds,
               coalesce(sum(CASE WHEN c.kind = 'wasted' THEN c.seconds END), 0) AS wasted_seconds,
               coalesce(sum(CASE WHEN c.kind = 'train' THEN c.usd END), 0) AS train_usd,
               coalesce(sum(CASE WHEN c.kind = 'wasted' THEN c.usd END), 0) AS wasted_usd,
               coalesce(sum(CASE WHEN c.kind = 'overhead' THEN c.usd END), 0) AS overhead_usd,
               coalesce(sum(c.usd), 0) AS usd, j.experiment
        FROM costs c JOIN instances i ON i.instance_id = c.instance_id AND i.purpose = 'train'
        LEFT JOIN group_members g ON g.run_id = c.run_id AND g.instance_id = c.instance_id
        LEFT JOIN jobs j ON j.job_id = c.job_id
        GROUP BY c.job_id, c.attempt, coalesce(g.node_rank, 0), c.instance_id, i.offer_id, j.experiment""",
    "current_best": """
        SELECT b.* FROM best_checkpoints b
        WHERE b.computed_at = (SELECT max(x.computed_at) FROM best_checkpoints x WHERE x.experiment = b.experiment)""",
    # The resume chain of every checkpoint: one row per (checkpoint, ancestor, depth).
    "checkpoint_lineage": """
        WITH RECURSIVE chain(checkpoint_key, ancestor_key, depth) AS (
            SELECT checkpoint_key, checkpoint_key, 0 FROM checkpoints
            UNION ALL
            SELECT chain.checkpoint_key, c.parent_key, chain.depth + 1
            FROM chain JOIN checkpoints c ON c.checkpoint_key = chain.ancestor_key
            WHERE c.parent_key IS NOT NULL AND chain.depth < 10000
        )
        SELECT chain.checkpoint_key, chain.depth, a.checkpoint_key AS ancestor_key, a.attempt, a.step, a.tier,
               a.lineage, a.sha256
        FROM chain JOIN checkpoints a ON a.checkpoint_key = chain.ancestor_key""",
}

NOW_EPOCH = {
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
    "postgresql": "extract(epoch from now())",
    "duckdb": "epoch(now())",
}


def view_sql(name: str, dialect: str) -> str:
    return VIEWS[name].replace("{now}", NOW_EPOCH[dialect])
