import pytest

from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import CheckpointManifest, StoreError, sha256_bytes


def manifest(step: int, files: dict[str, bytes]) -> CheckpointManifest:
    return CheckpointManifest(job_id="j", step=step, tier="durable",
                              files={k: {"sha256": sha256_bytes(v), "bytes": len(v)} for k, v in files.items()})


def test_round_trip_and_listing(tmp_path):
    store = open_store((tmp_path / "s").as_uri())
    files = {"state.pt": b"x" * 1000}
    uri = store.put("j", "step-000000001", files, manifest(1, files))
    assert list(store.list("j")) == [uri]
    m = store.fetch(uri, tmp_path / "out")
    assert m.step == 1 and (tmp_path / "out" / "state.pt").read_bytes() == files["state.pt"]


def test_truncated_or_changed_file_is_rejected(tmp_path):
    store = open_store(str(tmp_path / "s"))
    files = {"state.pt": b"abc" * 100}
    uri = store.put("j", "step-000000002", files, manifest(2, files))
    path = tmp_path / "s" / "j" / "step-000000002" / "state.pt"
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(StoreError) as err:
        store.fetch(uri, tmp_path / "out")
    assert "state.pt" in str(err.value)


def test_a_checkpoint_without_manifest_is_invisible(tmp_path):
    store = open_store(str(tmp_path / "s"))
    half = tmp_path / "s" / "j" / "step-000000003"
    half.mkdir(parents=True)
    (half / "state.pt").write_bytes(b"partial")
    assert list(store.list("j")) == []
    with pytest.raises(StoreError):
        store.read_manifest(half.as_uri())


def test_delete_tolerates_files_already_gone(tmp_path):
    store = open_store(str(tmp_path / "s"))
    files = {"state.pt": b"1"}
    uri = store.put("j", "step-000000004", files, manifest(4, files))
    assert store.delete(uri) is True
    assert store.delete(uri) is False
