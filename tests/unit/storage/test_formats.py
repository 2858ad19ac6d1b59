"""Manifest versions: what homes made before version 2 hold still reads, verifies and resumes;
version 2 is checked field by field when read."""
import json
import shutil

import pytest
import torch

from orbit_dagster.runtime.checkpointing import STATE_FILE, Checkpointer
from orbit_dagster.runtime.events import EventWriter
from orbit_dagster.runtime.notices import NoticeWatcher
from orbit_dagster.runtime.sdk import RunContext
from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import CheckpointManifest, ManifestError, StoreError
from tests.unit.runtime.test_agent import agent, events, final_weights, small_bundle
from tests.unit.storage.v1_format import v1_manifest_text, write_v1_fs

GOLDEN_FILES = {"state.pt": bytes(range(256)) * 40, "extra/notes.txt": b"step 7\n"}
GOLDEN_FIELDS = dict(job_id="job-v1", step=7, tier="durable", weights_sha256="ab" * 32,
                     parent="file:///old/job-v1/step-000000003-a1", created_at="2026-01-02T03:04:05+00:00", attempt=1,
                     meta={"metrics": {"train/loss": 1.25}})
# What main (f804083) wrote for GOLDEN_FILES and GOLDEN_FIELDS: FsStore.put's manifest.json, byte for byte.
GOLDEN_TEXT = (
    '{\n "attempt": 1,\n "created_at": "2026-01-02T03:04:05+00:00",\n "digest": "79ebfb016daa0c748c054dfafe7be0b97e0'
    'ad74cfb8082971216825a84da8d89",\n "files": {\n  "extra/notes.txt": {\n   "bytes": 7,\n   "sha256": "219cbbaff6f'
    'cdbc20c9f0efe639ef8829fe022afc28d5ca14376af5751a9ced0"\n  },\n  "state.pt": {\n   "bytes": 10240,\n   "sha256": '
    '"e96760a87768717bcebcfd25ddc7d46b4dbc95a4b0014def080c08539f7d90d0"\n  }\n },\n "job_id": "job-v1",\n "meta": {\n'
    '  "metrics": {\n   "train/loss": 1.25\n  }\n },\n "parent": "file:///old/job-v1/step-000000003-a1",\n "step": 7,\n'
    ' "tier": "durable",\n "weights_sha256": "abababababababababababababababababababababababababababababababab"\n}')
GOLDEN_DIGEST = "79ebfb016daa0c748c054dfafe7be0b97e0ad74cfb8082971216825a84da8d89"


def test_the_v1_fixture_writes_what_main_wrote():
    assert v1_manifest_text(files=GOLDEN_FILES, **GOLDEN_FIELDS) == GOLDEN_TEXT


def test_a_v1_checkpoint_reads_verifies_and_fetches_and_its_manifest_is_kept_byte_for_byte(tmp_path):
    store = open_store((tmp_path / "s").as_uri())
    uri = write_v1_fs(tmp_path / "s", "step-000000007-a1", GOLDEN_FILES, **GOLDEN_FIELDS)
    assert list(store.list("job-v1")) == [uri]
    m = store.read_manifest(uri)
    assert (m.version, m.digest, m.step, m.weights_sha256) == (1, GOLDEN_DIGEST, 7, "ab" * 32)
    assert m.to_json() == GOLDEN_TEXT  # re-written (an SSH copy, a fetch) as it was: its digest never changes
    assert store.verify(uri).digest == GOLDEN_DIGEST
    store.fetch(uri, tmp_path / "out")
    assert (tmp_path / "out" / "extra" / "notes.txt").read_bytes() == b"step 7\n"
    assert (tmp_path / "out" / "manifest.json").read_text() == GOLDEN_TEXT
    manifest, directory = store.checkout(uri, tmp_path / "scratch")
    assert directory == tmp_path.resolve() / "s" / "job-v1" / "step-000000007-a1" and manifest.digest == GOLDEN_DIGEST
    state = tmp_path / "s" / "job-v1" / "step-000000007-a1" / "state.pt"
    state.write_bytes(b"\x01" + state.read_bytes()[1:])
    with pytest.raises(StoreError, match="file state.pt does not match its manifest sha256"):
        store.verify(uri)
    with pytest.raises(StoreError, match="state.pt does not match"):
        store.fetch(uri, tmp_path / "out2")
    assert not (tmp_path / "out2" / "state.pt").exists()


def test_the_same_bytes_re_sent_in_the_new_format_are_kept_once_other_bytes_refused(tmp_path):
    store = open_store((tmp_path / "s").as_uri())
    uri = write_v1_fs(tmp_path / "s", "step-000000007-a1", GOLDEN_FILES, **GOLDEN_FIELDS)
    again = CheckpointManifest(**{**GOLDEN_FIELDS, "files": {}})
    assert store.put("job-v1", "step-000000007-a1", GOLDEN_FILES, again) == uri
    assert store.read_manifest(uri).to_json() == GOLDEN_TEXT  # the old manifest stays
    other = {**GOLDEN_FILES, "extra/notes.txt": b"step 8\n"}
    with pytest.raises(StoreError, match="already exists with other content"):
        store.put("job-v1", "step-000000007-a1", other, CheckpointManifest(**{**GOLDEN_FIELDS, "files": {}}))


def test_a_v1_checkpoint_resumes_through_the_sdk_and_the_chain_goes_on_in_v2(tmp_path):
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "optim": {"lr": torch.tensor(0.1)}, "step": 3}
    path = tmp_path / "blob.pt"
    torch.save(state, path)
    root = tmp_path / "s"
    uri = write_v1_fs(root, "step-000000003-a1", {STATE_FILE: path.read_bytes()},
                      job_id="job-v1", step=3, tier="durable", attempt=1)
    store = open_store(root.as_uri())
    ev = EventWriter(tmp_path / "events.jsonl")
    ctx = RunContext(job={"job_id": "job-v1", "template_snapshot": {}}, bundle_dir=tmp_path, workdir=tmp_path / "w",
                     attempt=2, events=ev, store=store, watcher=NoticeWatcher(None), checkpoint_every=1,
                     memory_every=1, resume_from=uri, expect_sha256=store.read_manifest(uri).digest)
    got = ctx.resume_state()
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["step"] == 3
    ctx.close()
    ck = Checkpointer(store, ev, job_id="job-v1", attempt=2, parent_uri=uri)
    ck.save_durable_async(4, got, {})
    ck.close()
    kinds = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [k["type"] for k in kinds if k["type"] in ("resumed", "checkpoint")] == ["resumed", "checkpoint"]
    new = store.read_manifest(kinds[-1]["uri"])
    assert new.version == 2 and new.parent == uri and store.verify(kinds[-1]["uri"]).format == "torch"


def test_an_agent_resumes_bit_identically_from_a_checkpoint_in_the_v1_format(tmp_path):
    """An old home's checkpoint (written by the code before version 2) resumes through the agent,
    and the run ends with the weights of an uninterrupted one."""
    b = small_bundle(tmp_path)
    full = agent(b.path, tmp_path / "w1", tmp_path / "s1")
    assert full.returncode == 0, (tmp_path / "w1" / "agent.log").read_text()
    crashed = agent(b.path, tmp_path / "w2", tmp_path / "s2", "--stop-after-step", "6")
    assert crashed.returncode == 99
    new = tmp_path / "s2" / "job-agent" / "step-000000004-a1"
    m = json.loads((new / "manifest.json").read_text())
    assert m["version"] == 2
    blob = (new / STATE_FILE).read_bytes()
    shutil.rmtree(new)  # the same checkpoint as the old code wrote it
    old = write_v1_fs(tmp_path / "s2", "step-000000004-a1", {STATE_FILE: blob}, job_id="job-agent",
                      step=4, tier="durable", weights_sha256=m["weights_sha256"], created_at=m["created_at"],
                      attempt=1, meta=m["meta"])
    resumed = agent(b.path, tmp_path / "w2", tmp_path / "s2", "--attempt", "2", "--resume-from", old)
    assert resumed.returncode == 0, (tmp_path / "w2" / "agent.log").read_text()
    assert [e["uri"] for e in events(tmp_path / "w2") if e["type"] == "resumed"] == [old]
    assert final_weights(tmp_path / "w2") == final_weights(tmp_path / "w1")


@pytest.mark.parametrize("change,field", [
    ({"version": 3}, "version 3"),
    ({"version": True}, "version True"),
    ({"part_size": 0}, "part_size 0"),
    ({"files": {"state.pt": {"bytes": 10, "parts": ["0" * 64, "1" * 64]}}}, "lists 2 parts for 10 bytes"),
    ({"files": {"state.pt": {"bytes": 10, "parts": ["not hex"]}}}, "no list of part sha256"),
    ({"files": {"state.pt": {"bytes": -1, "parts": []}}}, "no byte count"),
    ({"files": ["state.pt"]}, "'files' is not a mapping"),
    ({"surprise": 1}, "['surprise'] are unknown"),
])
def test_a_malformed_v2_manifest_is_refused_naming_the_field(change, field):
    good = {"version": 2, "job_id": "j", "step": 1, "tier": "durable", "part_size": 16,
            "files": {"state.pt": {"bytes": 10, "parts": ["a" * 64]}}}
    with pytest.raises(ManifestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        CheckpointManifest.from_json(json.dumps({**good, **change}))
    assert CheckpointManifest.from_json(json.dumps(good)).digest  # the unchanged one reads


def test_a_v1_manifest_with_v2_fields_or_without_a_sha256_is_refused():
    v1 = json.loads(GOLDEN_TEXT)
    with pytest.raises(ManifestError, match=r"\['part_size'\] are unknown"):
        CheckpointManifest.from_json(json.dumps({**v1, "part_size": 16}))
    del v1["files"]["state.pt"]["sha256"]
    with pytest.raises(ManifestError, match="has no sha256"):
        CheckpointManifest.from_json(json.dumps(v1))
