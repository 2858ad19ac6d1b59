"""The ledger is created only for a new home, refused when damaged, and told apart from a
swapped, reset or lost one by the id it holds and the home records (ledger/identity.py)."""
import json
import multiprocessing as mp
import os
import shutil
import sqlite3

import pytest

from orbit_dagster.ledger import Ledger, LedgerDamaged, LedgerError, LedgerIdentityError
from orbit_dagster.ledger import records as R
from orbit_dagster.ledger.identity import RECORD, inspect, read_id, read_record
from orbit_dagster.ledger.migrations import LATEST, current_version, upgrade_schema


def url_of(home):
    return f"sqlite:///{home / 'ledger' / 'ledger.sqlite'}"


def open_home(home) -> Ledger:
    """What Settings.ledger() does for a home: the cached, checked ledger."""
    return Ledger.open(url_of(home), home=home)


def fresh_process_open(home):
    """Open as a new process would (nothing cached in this one)."""
    return Ledger.reopen(url_of(home), home=home)


def db(home):
    return home / "ledger" / "ledger.sqlite"


def ledger_id_in(path) -> str:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute("SELECT ledger_id FROM ledger_identity").fetchone()[0]
    finally:
        con.close()


def settle(home) -> bytes:
    """Close this process's connections (the WAL folded into the file); the file's bytes."""
    Ledger.reopen(url_of(home), home=home).dispose()
    Ledger._open.clear()
    Ledger._admitted.clear()
    return db(home).read_bytes()


def test_a_new_home_makes_its_ledger_and_records_its_id(tmp_path):
    home = tmp_path / "home"
    ledger = open_home(home)
    entries = read_record(home)
    assert list(entries) == ["sqlite:ledger/ledger.sqlite"]
    assert entries["sqlite:ledger/ledger.sqlite"]["ledger_id"] == read_id(ledger) == ledger_id_in(db(home))
    assert current_version(ledger) == LATEST
    assert sorted(p.name for p in db(home).parent.iterdir() if not p.name.startswith("ledger.sqlite")) == []


@pytest.mark.parametrize("damage,words", [
    (lambda p: p.write_bytes(b""), "empty (0 bytes)"),
    (lambda p: p.write_bytes(p.read_bytes()[:60]), "less than a SQLite header"),
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2 + 123]), "whole number of"),
    (lambda p: p.write_bytes(p.read_bytes()[: 4096 * 3]), "bytes its header says it holds"),
    (lambda p: p.write_bytes(b"PK\x03\x04" + os.urandom(8188)), "not a SQLite database"),
    (lambda p: p.write_bytes(p.read_bytes()[:16] + b"\x00\x07" + p.read_bytes()[18:]), "page size of 7"),
], ids=["empty", "header-cut", "half", "whole-pages-cut", "not-sqlite", "bad-page-size"])
def test_a_damaged_ledger_file_is_refused_naming_it_and_left_as_it_was(tmp_path, damage, words):
    home = tmp_path / "home"
    open_home(home).append("events", R.event("before", job_id="j"))
    settle(home)
    damage(db(home))
    before = db(home).read_bytes()
    for attempt in (lambda: fresh_process_open(home), lambda: upgrade_schema(Ledger(url_of(home)))):
        with pytest.raises(LedgerDamaged) as err:
            attempt()
        line = str(err.value)
        assert words in line and str(db(home)) in line and "orbit ledger repair" in line and "\n" not in line
    assert db(home).read_bytes() == before  # never re-created, never written
    assert not db(home).with_name("ledger.sqlite-wal").exists()


def test_a_sqlite_file_without_the_ledger_tables_is_refused(tmp_path):
    home = tmp_path / "home"
    open_home(home)
    settle(home)
    db(home).unlink()
    sqlite3.connect(db(home)).execute("CREATE TABLE other (x)").connection.commit()
    with pytest.raises(LedgerDamaged, match="without the ledger's tables"):
        fresh_process_open(home)
    with pytest.raises(LedgerDamaged, match="without the ledger's tables"):
        upgrade_schema(Ledger(url_of(home)))


def test_a_swapped_ledger_is_refused_naming_both_ids(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine_id, other_id = read_id(open_home(mine)), read_id(open_home(other))
    settle(mine), settle(other)
    shutil.copyfile(db(other), db(mine))
    with pytest.raises(LedgerIdentityError) as err:
        fresh_process_open(mine)
    assert mine_id in str(err.value) and other_id in str(err.value) and "swapped" in str(err.value)
    assert read_record(mine)["sqlite:ledger/ledger.sqlite"]["ledger_id"] == mine_id  # the record is not rewritten


def test_a_ledger_without_an_id_in_a_home_that_recorded_one_is_refused(tmp_path):
    home = tmp_path / "home"
    recorded = read_id(open_home(home))
    settle(home)
    con = sqlite3.connect(db(home))
    con.execute("DROP TABLE ledger_identity")
    con.execute("DELETE FROM schema_migrations WHERE version = 5")
    con.commit()
    con.close()
    with pytest.raises(LedgerIdentityError, match=f"without an id.*{recorded}"):
        fresh_process_open(home)


def test_a_lost_ledger_the_home_recorded_is_refused_not_recreated(tmp_path):
    home = tmp_path / "home"
    recorded = read_id(open_home(home))
    settle(home)
    db(home).unlink()
    with pytest.raises(LedgerIdentityError, match=f"missing, but this home recorded ledger {recorded}"):
        fresh_process_open(home)
    assert not db(home).exists()


def test_an_older_home_adopts_its_ledgers_id(tmp_path):
    """A home made before ledgers had an id: its ledger gets one (migration 5), the home records it."""
    home = tmp_path / "home"
    open_home(home).append("events", R.event("kept", job_id="j"))
    settle(home)
    (home / RECORD).unlink()
    con = sqlite3.connect(db(home))  # the ledger as version 4 left it
    con.execute("DROP TABLE ledger_identity")
    con.execute("DELETE FROM schema_migrations WHERE version = 5")
    con.commit()
    con.close()
    (home / "bundles" / ("0" * 64)).mkdir(parents=True)  # its jobs' bundles: no reason to refuse
    ledger = fresh_process_open(home)
    assert current_version(ledger) == LATEST and ledger.scalar("SELECT count(*) FROM events") == 1
    assert read_record(home)["sqlite:ledger/ledger.sqlite"]["ledger_id"] == read_id(ledger)
    assert inspect(ledger).state == "ok"


def test_a_home_with_bundles_but_no_ledger_and_no_record_is_refused(tmp_path):
    home = tmp_path / "home"
    (home / "bundles" / ("a" * 64)).mkdir(parents=True)
    with pytest.raises(LedgerIdentityError, match="holds 1 bundle"):
        open_home(home)
    assert not db(home).exists() and not (home / RECORD).exists()


def test_a_recorded_home_makes_a_ledger_at_a_new_location(tmp_path):
    """Another ledger for the same home (another profile): the home's bundles may be the first one's."""
    home = tmp_path / "home"
    first = read_id(open_home(home))
    (home / "bundles" / ("a" * 64)).mkdir(parents=True)
    other = Ledger.open(f"sqlite:///{tmp_path / 'elsewhere.sqlite'}", home=home)
    entries = read_record(home)
    assert entries["sqlite:ledger/ledger.sqlite"]["ledger_id"] == first
    assert entries[f"sqlite:{tmp_path / 'elsewhere.sqlite'}"]["ledger_id"] == read_id(other) != first


def test_an_unreadable_record_is_refused_naming_it(tmp_path):
    home = tmp_path / "home"
    open_home(home)
    settle(home)
    (home / RECORD).write_text("{not json")
    with pytest.raises(LedgerIdentityError, match=f"{home / RECORD} is not readable"):
        fresh_process_open(home)


def _open_new_home(home: str, go: str, out) -> None:
    import time
    from pathlib import Path

    while not os.path.exists(go):
        time.sleep(0.005)
    try:
        out.put(read_id(Ledger.open(f"sqlite:///{Path(home) / 'ledger' / 'ledger.sqlite'}", home=Path(home))))
    except Exception as exc:  # reported to the test, which fails naming it
        out.put(f"{type(exc).__name__}: {exc}")


def test_processes_opening_a_new_home_at_once_make_one_ledger(tmp_path):
    home, go = tmp_path / "home", str(tmp_path / "go")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_open_new_home, args=(str(home), go, out)) for _ in range(4)]
    for p in procs:
        p.start()
    import time

    time.sleep(2.0)  # all four importing and waiting
    open(go, "w").close()
    ids = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert len(set(ids)) == 1 and len(ids[0]) == 36, ids  # one ledger, seen by all, never an empty one
    assert read_record(home)["sqlite:ledger/ledger.sqlite"]["ledger_id"] == ids[0] == ledger_id_in(db(home))
    assert sorted(p.name for p in db(home).parent.iterdir() if p.name.startswith(".")) == []  # no temp files left


def test_damaged_pages_met_later_are_one_error_naming_the_file(tmp_path):
    home = tmp_path / "home"
    ledger = open_home(home)
    with ledger.write() as tx:
        R.insert_job(tx, {"job_id": "j", "experiment": "e", "project": "p"}, [R.state_row("j", 1, "CREATED")])
    settle(home)
    con = sqlite3.connect(db(home))
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'jobs'").fetchone()[0]
    page = con.execute("PRAGMA page_size").fetchone()[0]
    con.close()
    data = bytearray(db(home).read_bytes())
    data[(root - 1) * page] = 0  # the b-tree page's type: not one SQLite knows
    db(home).write_bytes(bytes(data))
    ledger = fresh_process_open(home)  # the header and the schema are whole: opened
    with pytest.raises(LedgerDamaged) as err:
        ledger.rows("SELECT * FROM jobs")
    assert "database disk image is malformed" in str(err.value) and str(db(home)) in str(err.value)
    assert "orbit ledger repair" in str(err.value)
    assert inspect(ledger, deep=True).state == "damaged"


def test_ledger_errors_are_ledger_errors():
    assert issubclass(LedgerDamaged, LedgerError) and issubclass(LedgerIdentityError, LedgerError)


def test_the_record_is_one_json_file_naming_each_location(tmp_path):
    home = tmp_path / "home"
    open_home(home)
    body = json.loads((home / RECORD).read_text())
    assert "docs/reliability.md" in body["about"] and set(body["ledgers"]) == {"sqlite:ledger/ledger.sqlite"}



def test_an_older_ledger_left_by_a_power_cut_with_its_pages_in_the_log_opens_whole(tmp_path):
    """An older orbit-dagster made its ledger in place: until a checkpoint the file holds one
    page and the write-ahead log the rest; after a power cut, that is what the disk holds."""
    from orbit_dagster.ledger.migrations import _apply

    made = tmp_path / "made" / "ledger.sqlite"
    made.parent.mkdir()
    old = Ledger(f"sqlite:///{made}")
    _apply(old)  # in place, as before
    old.append("events", R.event("kept", job_id="j"))
    holder = sqlite3.connect(made)  # another process still holding it: no checkpoint on close
    holder.execute("SELECT count(*) FROM events").fetchone()
    home = tmp_path / "home"
    (home / "ledger").mkdir(parents=True)
    for suffix in ("", "-wal"):  # the two files as a disk holds them after the power cut
        shutil.copyfile(f"{made}{suffix}", f"{db(home)}{suffix}")
    holder.close()
    old.dispose()
    assert db(home).stat().st_size < db(home).with_name("ledger.sqlite-wal").stat().st_size
    ledger = fresh_process_open(home)  # adopted, nothing lost
    assert ledger.scalar("SELECT count(*) FROM events WHERE kind = 'kept'") == 1
    assert read_record(home)["sqlite:ledger/ledger.sqlite"]["ledger_id"] == read_id(ledger)
