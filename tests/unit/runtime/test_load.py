"""Loading a checkpoint through the SDK: a local store's file is verified, then mapped where
it lies (no second copy of the bytes); writes to the loaded tensors never reach the file; a
fetched copy is read into memory, so deleting it frees its space; torch's legacy format is read."""
import json
from pathlib import Path

import pytest
import torch

from orbit_dagster.runtime.checkpointing import STATE_FILE, Checkpointer
from orbit_dagster.runtime.encoding import map_setting
from orbit_dagster.runtime.events import EventWriter
from orbit_dagster.runtime.notices import NoticeWatcher
from orbit_dagster.runtime.sdk import RunContext
from orbit_dagster.storage.base import CheckpointManifest
from orbit_dagster.storage.fs import FsStore


def state():
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(256, 1024, generator=g)}, "optim": {"m": torch.randn(300_000, generator=g)},
            "step": 5}


def saved(tmp_path, store) -> str:
    ev = EventWriter(tmp_path / "events.jsonl")
    ck = Checkpointer(store, ev, job_id="j", attempt=1, parent_uri=None)
    ck.save_durable_async(5, state(), {})
    ck.close()
    (uri,) = [e["uri"] for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
              if e["type"] == "checkpoint"]
    return uri


def resume(tmp_path, store, uri):
    ctx = RunContext(job={"job_id": "j", "template_snapshot": {}}, bundle_dir=tmp_path, workdir=tmp_path / "w",
                     attempt=2, events=EventWriter(tmp_path / "load-events.jsonl"), store=store,
                     watcher=NoticeWatcher(None), checkpoint_every=1, memory_every=1, resume_from=uri)
    try:
        return ctx.resume_state()
    finally:
        ctx.close()


def mapped_file(t: torch.Tensor) -> str | None:
    """The file whose mapping holds the tensor's bytes (None: anonymous memory)."""
    ptr = t.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def test_a_local_checkpoint_is_mapped_where_it_lies_and_writes_to_the_loaded_state_never_reach_it(tmp_path):
    store = FsStore((tmp_path / "store").as_uri())
    uri = saved(tmp_path, store)
    got = resume(tmp_path, store, uri)
    expected = state()
    assert torch.equal(got["model"]["w"], expected["model"]["w"]) and torch.equal(got["optim"]["m"], expected["optim"]["m"])
    assert mapped_file(got["optim"]["m"]) == str(Path(uri[len("file://"):]) / STATE_FILE)  # no copy made
    got["optim"]["m"].mul_(0.5).add_(1.0)  # an optimiser step on the loaded moments
    got["model"]["w"].zero_()
    store.verify(uri)  # every part still matches: the writes went to private pages
    again = resume(tmp_path, store, uri)
    assert torch.equal(again["optim"]["m"], expected["optim"]["m"]) and torch.equal(again["model"]["w"], expected["model"]["w"])


class FetchingStore(FsStore):
    """A store whose checkout fetches into the scratch directory, as a remote store's does."""

    def checkout(self, uri, scratch):
        return self.fetch(uri, scratch), Path(scratch)


def test_a_fetched_copy_is_read_into_memory_so_deleting_it_frees_its_space(tmp_path):
    store = FetchingStore((tmp_path / "store").as_uri())
    uri = saved(tmp_path, store)
    got = resume(tmp_path, store, uri)
    assert torch.equal(got["optim"]["m"], state()["optim"]["m"])
    assert mapped_file(got["optim"]["m"]) is None
    assert not list((tmp_path / "w").glob("resume-*"))  # the fetched copy is gone


def test_a_checkpoint_in_torchs_legacy_format_cannot_be_mapped_and_is_read(tmp_path):
    store = FsStore((tmp_path / "store").as_uri())
    with store.writer("j", "step-000000005-a1") as w:
        with w.open(STATE_FILE) as fh:
            torch.save(state(), fh, _use_new_zipfile_serialization=False)
        w.commit(CheckpointManifest(job_id="j", step=5, tier="durable", files={}, format="torch"))
    got = resume(tmp_path, store, w.uri)
    assert torch.equal(got["model"]["w"], state()["model"]["w"]) and mapped_file(got["model"]["w"]) is None


def test_orbit_load_mmap_0_reads_a_local_checkpoint_into_memory(tmp_path, monkeypatch):
    store = FsStore((tmp_path / "store").as_uri())
    uri = saved(tmp_path, store)
    monkeypatch.setenv("ORBIT_LOAD_MMAP", "0")  # a network file system: never map
    got = resume(tmp_path, store, uri)
    assert torch.equal(got["optim"]["m"], state()["optim"]["m"]) and mapped_file(got["optim"]["m"]) is None


@pytest.mark.parametrize("raw", ["yes", "2", "", "1\x00"])
def test_a_bad_orbit_load_mmap_is_refused_naming_the_variable_and_the_fix(raw):
    with pytest.raises(ValueError, match=r"ORBIT_LOAD_MMAP=.* is neither 0 nor 1; fix: ORBIT_LOAD_MMAP=1"):
        map_setting({"ORBIT_LOAD_MMAP": raw})
    assert map_setting({}) is True and map_setting({"ORBIT_LOAD_MMAP": " 0 "}) is False
