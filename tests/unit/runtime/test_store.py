import pytest

from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import CheckpointManifest, StoreError, sha256_bytes


def manifest(step: int, files: dict[str, bytes]) -> CheckpointManifest:
    return CheckpointManifest(job_id="j", step=step, tier="durable",
                              files={k: {"sha256": sha256_bytes(v), "bytes": len(v)} for k, v in files.items()})


def test_round_trip_and_listing(tmp_path):
    store = open_store((tmp_path / "s").as_uri())
    files = {"state.pt": b"x" * 1000}
    uri = store.put("j", "step-000000001-a1", files, manifest(1, files))
    assert list(store.list("j")) == [uri]
    m = store.fetch(uri, tmp_path / "out")
    assert m.step == 1 and (tmp_path / "out" / "state.pt").read_bytes() == files["state.pt"]


def test_truncated_or_changed_file_is_rejected(tmp_path):
    store = open_store(str(tmp_path / "s"))
    files = {"state.pt": b"abc" * 100}
    uri = store.put("j", "step-000000002-a1", files, manifest(2, files))
    path = tmp_path / "s" / "j" / "step-000000002-a1" / "state.pt"
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(StoreError) as err:
        store.fetch(uri, tmp_path / "out")
    assert "state.pt" in str(err.value)


def test_a_checkpoint_without_manifest_is_invisible(tmp_path):
    store = open_store(str(tmp_path / "s"))
    half = tmp_path / "s" / "j" / "step-000000003-a1"
    half.mkdir(parents=True)
    (half / "state.pt").write_bytes(b"partial")
    assert list(store.list("j")) == []
    with pytest.raises(StoreError):
        store.read_manifest(half.as_uri())


def test_delete_tolerates_files_already_gone(tmp_path):
    store = open_store(str(tmp_path / "s"))
    files = {"state.pt": b"1"}
    uri = store.put("j", "step-000000004-a1", files, manifest(4, files))
    assert store.delete(uri) is True
    assert store.delete(uri) is False


def test_different_bytes_under_an_existing_name_are_an_error_never_a_silent_keep(tmp_path):
    store = open_store(str(tmp_path / "s"))
    first = {"state.pt": b"lr=0.003 weights"}
    uri = store.put("j", "step-000000040-a1", first, manifest(40, first))
    assert store.put("j", "step-000000040-a1", first, manifest(40, first)) == uri  # the same one again: fine
    other = {"state.pt": b"lr=0.01 weights"}
    with pytest.raises(StoreError, match="already exists with other content"):
        store.put("j", "step-000000040-a1", other, manifest(40, other))
    assert (tmp_path / "s" / "j" / "step-000000040-a1" / "state.pt").read_bytes() == first["state.pt"]


@pytest.mark.parametrize("job,name,rel", [
    ("..", "step-000000001-a1", "state.pt"),
    ("j", "../../../tmp/x", "state.pt"),
    ("j/../..", "step-000000001-a1", "state.pt"),
    ("j", "step-000000001-a1", "../../escape"),
    ("j", "step-000000001-a1", "/etc/passwd"),
    ("j", "step-000000001-a1", "manifest.json"),
])
def test_names_that_leave_the_store_are_refused(tmp_path, job, name, rel):
    store = open_store(str(tmp_path / "s"))
    files = {rel: b"x"}
    with pytest.raises(StoreError):
        store.put(job, name, files, manifest(1, files))
    assert not (tmp_path / "escape").exists() and not any(tmp_path.glob("tmp/x"))


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    store = open_store(str(tmp_path / "s"))
    files = {"state.pt": b"x"}
    uri = store.put("j", "step-000000001-a1", files, manifest(1, files))
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    ckpt = tmp_path / "s" / "j" / "step-000000001-a1"
    (ckpt / "state.pt").unlink()
    (ckpt / "state.pt").symlink_to(secret)
    with pytest.raises(StoreError, match="link out of the checkpoint"):
        store.fetch(uri, tmp_path / "out")
    assert not (tmp_path / "out" / "state.pt").exists()


def test_temp_dirs_of_killed_writers_are_swept(tmp_path):
    import os
    import time

    store = open_store(str(tmp_path / "s"))
    dead = tmp_path / "s" / "j" / ".tmp-step-000000001-a1-999-dead"
    dead.mkdir(parents=True)
    old = time.time() - 7200
    os.utime(dead, (old, old))
    fresh = tmp_path / "s" / "j" / ".tmp-step-000000002-a1-999-live"
    fresh.mkdir()
    files = {"state.pt": b"x"}
    store.put("j", "step-000000003-a1", files, manifest(3, files))
    assert not dead.exists() and fresh.exists()  # a writer still at work is left alone
