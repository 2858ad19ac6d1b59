"""A checkpoint the store holds but the ledger does not (its host lost before its events were
read) is registered from its manifest, once, in the lineage of the attempt that wrote it."""
import time

from orbit_dagster.control.checkpoints import scan_store
from orbit_dagster.ledger import records as R
from orbit_dagster.runtime.checkpointing import Checkpointer
from orbit_dagster.runtime.events import EventWriter
from orbit_dagster.settings import Settings
from orbit_dagster.storage import open_store
from tests.unit.runtime.test_checkpointing import make_state


def test_a_checkpoint_only_the_store_holds_is_registered_once_from_its_manifest(orbit_home, tmp_path):
    ledger = Settings.from_env(orbit_home).ledger()
    now = time.time()
    with ledger.write() as tx:
        R.insert_job(tx, {"job_id": "j", "experiment": "e", "project": "p", "created_at": now},
                     [R.state_row("j", 1, "RUNNING")])
        tx.insert("runs", [{"run_id": R.run_id_for("j", 1), "job_id": "j", "attempt": 1, "lineage": "L1",
                            "provider": "sim", "experiment": "e", "project": "p", "started_at": now,
                            "state": "RUNNING", "state_at": now}])
    store_uri = (tmp_path / "store").as_uri()
    ck = Checkpointer(open_store(store_uri), EventWriter(tmp_path / "events.jsonl"), job_id="j", attempt=1,
                      parent_uri=None)
    ck.save_durable_async(10, make_state(), {"train/loss": 1.5})
    ck.flush()
    ck.close()

    (row,) = scan_store(ledger, store_uri, "j", eval_suite=None)
    assert (row["checkpoint_key"], row["lineage"], row["step"], row["train_loss"]) == ("j/a1/10", "L1", 10, 1.5)
    assert [r["checkpoint_key"] for r in R.checkpoints(ledger, "j")] == ["j/a1/10"]
    assert scan_store(ledger, store_uri, "j", eval_suite=None) == []  # a second scan registers nothing
