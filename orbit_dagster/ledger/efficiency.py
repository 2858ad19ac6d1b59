"""Cost efficiency per provider, offer and GPU model: the DuckDB face's `cost_efficiency` views.

What a team asks after "what did it cost": where a dollar bought the most compute. Per
(provider, offer, GPU model), over the instances the providers have billed (stopped ones;
a running instance is billed when it stops, as in `orbit cost`):

| column | meaning |
|---|---|
| `instances`, `instance_hours`, `gpu_hours` | billed instances and their time (GPU-hours: x GPUs per instance) |
| `usd` | what was paid: each instance's bill (`instances.billed_usd`); the rows sum to the bill |
| `wasted_usd` | work lost after the last checkpoint of a lost attempt (the `wasted` cost lines) |
| `recovery_usd` | what reclaims cost beyond the lost work: `wasted_usd` plus each resumed attempt's restore (its instance's start to the host's `resumed` record) |
| `useful_gpu_hours` | GPU-hours attributed to checkpoints and evaluations (the `train` and `eval` lines), less those restores |
| `tflops_per_gpu`, `tflops_source` | dense TFLOP/s per GPU: the agent's probe on that instance when it measured a GPU (`probe`), else the catalog's figure the offer carried when it was rented (`catalog measured`, from an earlier probe of that offer, else `catalog spec`, Epoch AI's dense BF16); `unknown` when neither exists |
| `effective_tflop_hours` | useful GPU-hours x TFLOP/s per GPU, instance by instance |
| `usd_per_effective_tflop_hour` | `usd` / `effective_tflop_hours`: every paid second, wasted ones included, per unit of useful compute (NULL when a TFLOPS figure is unknown for any instance of the row) |
| `interruptions`, `interruptions_per_hour` | attempts lost to a reclaim on these instances, per instance-hour |
| `recovery_share` | `recovery_usd` / `usd` |

A CPU probe (the embedded market's hosts are CPU processes) never stands for a GPU: such an
instance is measured by the catalog's figure. The views read only the ledger's own tables
(the instance's handle carries the offer it was rented at), so `ledger.duckdb` has them too.
DuckDB SQL: they are the face's (`face.define_views`), not the store's.
"""
from __future__ import annotations

# One row per billed instance, with what the grouped view needs; filters (an experiment, a
# job) apply here, before grouping.
PER_INSTANCE = """
WITH probe AS (
    SELECT instance_id, arg_max(TRY_CAST(json_extract_string(detail, '$.tflops') AS DOUBLE), ts) AS tflops
    FROM events
    WHERE kind = 'host_probe' AND instance_id IS NOT NULL
      AND coalesce(json_extract_string(detail, '$.device'), 'cpu') NOT LIKE 'cpu%'
    GROUP BY instance_id
), resumed AS (
    SELECT instance_id, min(TRY_CAST(json_extract_string(detail, '$.ts') AS DOUBLE)) AS at
    FROM events WHERE kind = 'host_resumed' AND instance_id IS NOT NULL GROUP BY instance_id
), lines AS (
    SELECT instance_id,
           sum(CASE WHEN kind IN ('train', 'eval') THEN seconds ELSE 0 END) AS worked_s,
           sum(CASE WHEN kind = 'wasted' THEN usd ELSE 0 END) AS wasted_usd
    FROM costs GROUP BY instance_id
), reclaims AS (
    SELECT instance_id, count(*) AS n FROM runs
    WHERE state = 'LOST' AND coalesce(failure_class, '') = 'reclaim' AND instance_id IS NOT NULL
    GROUP BY instance_id
), base AS (
    SELECT i.instance_id, i.provider, i.offer_id, i.gpu, i.job_id, j.experiment, i.purpose,
           greatest(coalesce(i.gpu_count, 1), 1) AS gpus,
           greatest(i.stopped_at - i.started_at, 0) AS seconds,
           coalesce(i.billed_usd, 0) AS usd, coalesce(i.usd_per_second, 0) AS usd_per_second,
           coalesce(l.worked_s, 0) AS worked_s, coalesce(l.wasted_usd, 0) AS wasted_usd,
           CASE WHEN r.at IS NULL THEN 0 ELSE greatest(r.at - i.started_at, 0) END AS restore_at_s,
           p.tflops AS probe_tflops,
           TRY_CAST(json_extract_string(i.handle, '$.offer.measured_tflops') AS DOUBLE) AS catalog_measured,
           TRY_CAST(json_extract_string(i.handle, '$.offer.spec_tflops_bf16') AS DOUBLE) AS catalog_spec,
           coalesce(k.n, 0) AS interruptions
    FROM instances i
    LEFT JOIN jobs j ON j.job_id = i.job_id
    LEFT JOIN lines l ON l.instance_id = i.instance_id
    LEFT JOIN resumed r ON r.instance_id = i.instance_id
    LEFT JOIN probe p ON p.instance_id = i.instance_id
    LEFT JOIN reclaims k ON k.instance_id = i.instance_id
    WHERE i.stopped_at IS NOT NULL
)
SELECT instance_id, provider, offer_id, gpu, job_id, experiment, purpose, gpus, seconds, usd, wasted_usd,
       -- the restore is inside the attempt's first checkpoint's line: at most what was worked
       least(restore_at_s, worked_s) AS restore_s,
       greatest(worked_s - least(restore_at_s, worked_s), 0) * gpus AS useful_gpu_s,
       wasted_usd + least(restore_at_s, worked_s) * usd_per_second AS recovery_usd,
       coalesce(probe_tflops, catalog_measured, catalog_spec) AS tflops_per_gpu,
       CASE WHEN probe_tflops IS NOT NULL THEN 'probe'
            WHEN catalog_measured IS NOT NULL THEN 'catalog measured'
            WHEN catalog_spec IS NOT NULL THEN 'catalog spec' ELSE 'unknown' END AS tflops_source,
       interruptions
FROM base"""


def grouped(where: str = "") -> str:
    """The per-(provider, offer, GPU) rows over `cost_efficiency_instances`, filtered by `where`
    (SQL after WHERE, or empty)."""
    return f"""
SELECT provider, offer_id, gpu, count(*) AS instances,
       sum(seconds) / 3600.0 AS instance_hours, sum(seconds * gpus) / 3600.0 AS gpu_hours,
       sum(usd) AS usd, sum(wasted_usd) AS wasted_usd, sum(recovery_usd) AS recovery_usd,
       sum(useful_gpu_s) / 3600.0 AS useful_gpu_hours,
       CASE WHEN count(tflops_per_gpu) = count(*) THEN sum(useful_gpu_s * tflops_per_gpu) / sum(useful_gpu_s) END
           AS tflops_per_gpu,
       string_agg(DISTINCT tflops_source, ', ' ORDER BY tflops_source) AS tflops_source,
       CASE WHEN count(tflops_per_gpu) = count(*) THEN sum(useful_gpu_s * tflops_per_gpu) / 3600.0 END
           AS effective_tflop_hours,
       CASE WHEN count(tflops_per_gpu) = count(*) AND sum(useful_gpu_s * tflops_per_gpu) > 0
            THEN sum(usd) / (sum(useful_gpu_s * tflops_per_gpu) / 3600.0) END AS usd_per_effective_tflop_hour,
       CAST(sum(interruptions) AS BIGINT) AS interruptions,
       CASE WHEN sum(seconds) > 0 THEN sum(interruptions) / (sum(seconds) / 3600.0) END AS interruptions_per_hour,
       CASE WHEN sum(usd) > 0 THEN sum(recovery_usd) / sum(usd) END AS recovery_share
FROM cost_efficiency_instances
{'WHERE ' + where if where else ''}
GROUP BY provider, offer_id, gpu"""


ORDER = "ORDER BY usd_per_effective_tflop_hour NULLS LAST, provider, offer_id, gpu"

# name -> DuckDB SQL; defined in this order (the second reads the first).
FACE_VIEWS: dict[str, str] = {
    "cost_efficiency_instances": PER_INSTANCE,
    "cost_efficiency": grouped(),
}


def literal(value: str) -> str:
    """A SQL string literal (single quotes doubled: DuckDB reads backslashes literally)."""
    return "'" + str(value).replace("'", "''") + "'"


def efficiency_query(*, experiment: str | None = None, job: str | None = None) -> str:
    """The grouped rows of one experiment's or job's instances (all when neither), cheapest
    effective compute first."""
    terms = [f"{column} = {literal(value)}" for column, value in (("experiment", experiment), ("job_id", job))
             if value is not None]
    return grouped(" AND ".join(terms)) + "\n" + ORDER
