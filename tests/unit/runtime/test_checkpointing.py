"""The checkpoint save path: one hash per byte (per part, streamed), host copies, honest timings, deltas by bytes."""
import json
import threading
import time

import pytest
import torch

from orbit_dagster.runtime import delta as D
from orbit_dagster.runtime.checkpointing import STATE_FILE, Checkpointer
from orbit_dagster.runtime.encoding import stage, weights_digest, write_state
from orbit_dagster.runtime.events import EventWriter
from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import CheckpointManifest, sha256_bytes
from orbit_dagster.storage.fs import FsStore


def make_state(seed=0, n=4, size=64 * 1024):
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.weight": torch.randn(size, generator=g) for i in range(n)}
    model["head.weight"] = torch.randn(1024, generator=g)
    optim = {"state": {i: {"exp_avg": torch.randn(size, generator=g), "step": torch.tensor(3.0)} for i in range(n)},
             "param_groups": [{"lr": 0.1, "params": list(range(n))}]}
    return {"model": model, "optim": optim, "step": 7, "vocab": "abc"}


def checkpoints(tmp_path):
    path = tmp_path / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["type"] == "checkpoint"] if path.exists() else []


def checkpointer(tmp_path, store=None):
    store = store or open_store((tmp_path / "store").as_uri())
    return Checkpointer(store, EventWriter(tmp_path / "events.jsonl"), job_id="j", attempt=1, parent_uri=None), store


def load(store, uri, tmp_path):
    _, directory = store.checkout(uri, tmp_path / f"fetched-{uri.rsplit('/', 1)[-1]}-{time.monotonic_ns()}")
    return torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)


def assert_same(a, b):
    fa, fb = D.flatten(a), D.flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert (D.same_bytes(fa[k], fb[k]) if isinstance(fa[k], torch.Tensor) else fa[k] == fb[k]), k


def save(store, state, name="step-000000001-a1"):
    with store.writer("j", name) as w:
        weights = write_state(w, STATE_FILE, state, state["model"])
        manifest = w.commit(CheckpointManifest(job_id="j", step=1, tier="durable", files={}, format="torch"))
    return w.uri, manifest, weights


def test_the_stream_hashes_exactly_the_bytes_it_writes_and_leaves_torch_settings_alone(tmp_path):
    from torch.utils.serialization import config

    store = FsStore((tmp_path / "s").as_uri(), part_size=64 * 1024)  # small parts: many of them
    state = make_state()
    uri, manifest, weights = save(store, state)
    blob = (tmp_path / "s" / "j" / "step-000000001-a1" / STATE_FILE).read_bytes()
    parts = [sha256_bytes(blob[i:i + 64 * 1024]) for i in range(0, len(blob), 64 * 1024)]
    assert manifest.files[STATE_FILE] == {"bytes": len(blob), "parts": parts} and len(parts) > 10
    assert manifest.version == 2 and manifest.format == "torch" and weights == weights_digest(state["model"])
    assert_same(torch.load(tmp_path / "s" / "j" / "step-000000001-a1" / STATE_FILE, weights_only=True), state)
    assert config.save.compute_crc32 is True  # switched off only while our save ran


def test_overlapping_saves_restore_the_crc_setting(tmp_path):
    from torch.utils.serialization import config

    store = FsStore((tmp_path / "s").as_uri())
    states = [make_state(seed=i, size=256 * 1024) for i in range(4)]
    threads = [threading.Thread(target=save, args=(store, s, f"step-00000000{i}-a1")) for i, s in enumerate(states)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert config.save.compute_crc32 is True
    assert len(list(store.list("j"))) == 4


def test_the_weights_digest_errors_reach_the_caller_and_nothing_is_committed(tmp_path):
    store = FsStore((tmp_path / "s").as_uri())
    state = make_state()
    with pytest.raises(AttributeError):
        with store.writer("j", "step-000000001-a1") as w:
            write_state(w, STATE_FILE, state, {"w": "not a tensor"})
            w.commit(CheckpointManifest(job_id="j", step=1, tier="durable", files={}))
    assert list(store.list("j")) == [] and not list((tmp_path / "s" / "j").iterdir())


def test_stage_is_a_copy_later_steps_cannot_change():
    state = make_state()
    state["model"]["strided"] = torch.randn(64, 32).t()  # not contiguous
    host = stage(state)
    assert_same(host, state)
    state["model"]["layer0.weight"].add_(1.0)
    state["optim"]["param_groups"][0]["params"].append(99)
    assert not D.same_bytes(host["model"]["layer0.weight"], state["model"]["layer0.weight"])
    assert host["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    # The buffers of an earlier copy nothing reads any more are refilled where they match
    # (no new memory to fault in); one of another shape is not, and the copy is still whole.
    spare = {k: v for k, v in D.flatten(host).items() if isinstance(v, torch.Tensor)}
    spare['["model", "layer0.weight"]'] = torch.zeros(3)
    again = stage(state, spare)
    assert_same(again, state)
    assert again["model"]["layer1.weight"].data_ptr() == spare['["model", "layer1.weight"]'].data_ptr()
    assert again["model"]["strided"].data_ptr() == spare['["model", "strided"]'].data_ptr()
    assert again["model"]["layer0.weight"].data_ptr() != spare['["model", "layer0.weight"]'].data_ptr()


def test_a_large_host_copy_is_cut_into_pieces_on_the_copy_threads_and_is_whole(monkeypatch):
    from orbit_dagster.runtime import encoding as E

    # Small pieces and threshold, so a test-sized state takes the path a 1 GB state takes.
    monkeypatch.setattr(E, "PIECE_BYTES", 4096)
    monkeypatch.setattr(E, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(E, "copy_threads", lambda: 3)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # a job pinned to 1 torch thread
    seen = set()  # the threads that ran a piece
    real = E._copy_pool

    class Watched:
        def submit(self, fn, *args):
            def piece():
                seen.add(threading.current_thread().name)
                return fn(*args)
            return real().submit(piece)

    monkeypatch.setattr(E, "_copy_pool", Watched)
    state = make_state(n=3, size=10_001)  # pieces of 1,024 floats and an uneven last one
    state["model"]["strided"] = torch.randn(64, 32).t()  # copied whole
    state["model"]["ints"] = torch.arange(5000, dtype=torch.int64)
    state["model"]["empty"] = torch.empty(0)
    spare = {k: torch.full_like(v, 7) for k, v in D.flatten(stage(state)).items() if isinstance(v, torch.Tensor)}
    host = stage(state, spare)
    assert_same(host, state)
    assert host["model"]["layer2.weight"].data_ptr() == spare['["model", "layer2.weight"]'].data_ptr()
    assert seen and all(name.startswith("orbit-copy") for name in seen)  # the copies ran on the copy threads
    # Where torch has a thread per core already, its own copy shares the work out: no pieces.
    seen.clear()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert_same(stage(state, spare), state)
    assert not seen
    # An error in one piece (a size mismatch) reaches the caller.
    monkeypatch.setattr(E, "_copy_pool", real)
    with pytest.raises(RuntimeError):
        E.copy_pieces([(torch.empty(10_000), torch.randn(10_000)), (torch.empty(3), torch.randn(5))])


def test_same_bytes_is_exact():
    z = torch.zeros(4)
    assert D.same_bytes(z, torch.zeros(4))
    assert not D.same_bytes(z, -torch.zeros(4))  # equal as numbers, different bits
    assert not D.same_bytes(z, torch.zeros(4, dtype=torch.float64))
    assert not D.same_bytes(z, torch.zeros(2, 2))
    assert not D.same_bytes(z, None)


def test_durable_save_is_consistent_verified_and_reports_its_times(tmp_path):
    ck, store = checkpointer(tmp_path)
    state = make_state()
    expected = stage(state)
    ck.save_durable_async(10, state, {"train/loss": 1.5})
    for t in D.flatten(state).values():  # the next optimiser step, while the save is written
        if isinstance(t, torch.Tensor):
            t.add_(1)
    ck.flush()
    (ev,) = checkpoints(tmp_path)
    manifest = store.verify(ev["uri"])
    assert manifest.weights_sha256 == ev["weights_sha256"] == weights_digest(expected["model"])
    assert_same(load(store, ev["uri"], tmp_path), expected)
    assert 0 <= ev["blocked_seconds"] <= ev["save_seconds"] and 0 < ev["write_seconds"] <= ev["save_seconds"]
    ck.close()


class SlowStore(FsStore):
    """A filesystem store whose writes take at least `delay` seconds (a slow disk or network)."""

    delay = 1.0

    def writer(self, *args, **kw):
        time.sleep(self.delay)
        return super().writer(*args, **kw)


def test_blocked_time_includes_waiting_for_the_writer_and_save_time_includes_both(tmp_path):
    ck, _ = checkpointer(tmp_path, SlowStore((tmp_path / "slow").as_uri()))
    t0 = time.perf_counter()
    for step in (1, 2, 3):
        ck.save_durable_async(step, make_state(seed=step), {})
    # First: written at once; second: queued; third: waits until the first is written.
    assert time.perf_counter() - t0 >= SlowStore.delay * 0.9
    ck.flush()
    ev = {e["step"]: e for e in checkpoints(tmp_path)}
    assert ev[1]["blocked_seconds"] < SlowStore.delay / 2
    assert ev[3]["blocked_seconds"] >= SlowStore.delay / 2
    assert ev[3]["save_seconds"] >= ev[3]["blocked_seconds"] + SlowStore.delay  # then its own write
    assert all(e["write_seconds"] >= SlowStore.delay for e in ev.values())
    ck.close()


def test_emergency_delta_against_the_landed_base_resumes_exactly(tmp_path):
    ck, store = checkpointer(tmp_path)
    state = make_state()
    ck.save_durable_async(10, state, {})
    ck.flush()
    state["model"]["head.weight"].mul_(0.5)  # a head-only fine-tune: the body is frozen
    state["step"] = 12
    uri = ck.save_emergency(12, state, {}, source="sigterm")
    durable, emergency = checkpoints(tmp_path)
    assert emergency["delta_of"] == durable["uri"] and emergency["changed_measure"] == "bytes"
    assert 0 < emergency["changed_fraction"] < 0.05 and emergency["bytes"] < durable["bytes"] / 5
    assert emergency["blocked_seconds"] == emergency["save_seconds"]  # the training thread did it all
    saved = load(store, uri, tmp_path)
    assert D.is_delta(saved)
    assert_same(D.apply_delta(load(store, durable["uri"], tmp_path), saved), state)
    assert emergency["weights_sha256"] == weights_digest(state["model"])
    ck.close()


def test_full_fine_tune_keeps_no_base_and_saves_in_full(tmp_path):
    ck, store = checkpointer(tmp_path)
    state = make_state()

    def train_step():
        for t in D.flatten(state).values():
            if isinstance(t, torch.Tensor):
                t.add_(0.01)

    ck.save_durable_async(1, state, {})
    ck.flush()
    assert ck._base is not None  # the first save: no history yet, kept
    # ... so the next save cannot copy into it: its buffers were readied on the writer thread
    # (new memory, touched there), none of them the base's.
    readied = dict(ck._spare)
    base = ck._base[1]
    assert set(readied) == {k for k, v in base.items() if isinstance(v, torch.Tensor)}
    assert all(readied[k].shape == base[k].shape and readied[k].dtype == base[k].dtype
               and readied[k].data_ptr() != base[k].data_ptr() for k in readied)
    train_step()
    ck.save_durable_async(2, state, {})
    ck.flush()
    assert_same(load(store, checkpoints(tmp_path)[-1]["uri"], tmp_path / "2"), state)
    # All of it was written to: no delta base kept; the written copy's buffers wait for the next save.
    assert ck._base is None and set(ck._spare) == {k for k, v in D.flatten(state).items() if isinstance(v, torch.Tensor)}
    spare = dict(ck._spare)
    assert all(spare[k].data_ptr() == v.data_ptr() for k, v in readied.items())  # save 2 copied into them
    train_step()
    ck.save_durable_async(3, state, {})
    ck.flush()
    assert_same(load(store, checkpoints(tmp_path)[-1]["uri"], tmp_path / "3"), state)  # refilled, not stale
    assert all(ck._spare[k].data_ptr() == v.data_ptr() for k, v in spare.items())  # the same memory again
    train_step()
    uri = ck.save_emergency(4, state, {}, source="sigterm")
    ev = checkpoints(tmp_path)[-1]
    assert "delta_of" not in ev and ev["changed_measure"] == "writes" and ev["changed_fraction"] > 0.99
    assert_same(load(store, uri, tmp_path), state)
    ck.close()


def test_no_room_to_ready_the_next_saves_buffers_is_not_an_error(tmp_path, monkeypatch):
    import orbit_dagster.runtime.checkpointing as C

    def no_memory(flat):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(C, "buffers_like", no_memory)
    ck, store = checkpointer(tmp_path)
    state = make_state()
    ck.save_durable_async(1, state, {})
    ck.flush()
    assert ck._base is not None and ck._spare is None  # kept as the base; nothing readied
    state["model"]["layer0.weight"].add_(1.0)
    ck.save_durable_async(2, state, {})  # no writer error surfaces: it copies into new memory
    ck.flush()
    assert [c["step"] for c in checkpoints(tmp_path)] == [1, 2]
    assert_same(load(store, checkpoints(tmp_path)[-1]["uri"], tmp_path / "2"), state)
    ck.close()


def test_emergency_from_memory_does_not_block_training(tmp_path):
    ck, store = checkpointer(tmp_path)
    state = make_state()
    ck.snapshot_memory(5, state, {"train/loss": 2.0})
    state["model"]["layer0.weight"].add_(1)  # the step in progress changes the live state
    uri = ck.emergency_from_memory(source="memory-snapshot")
    ev = checkpoints(tmp_path)[-1]
    assert ev["blocked_seconds"] == 0.0 and ev["step"] == 5 and ev["source"] == "memory-snapshot"
    assert not D.same_bytes(load(store, uri, tmp_path)["model"]["layer0.weight"], state["model"]["layer0.weight"])
    ck.close()


def test_memory_snapshots_respect_their_cost_budget(tmp_path, monkeypatch):
    import orbit_dagster.runtime.checkpointing as C

    ck, _ = checkpointer(tmp_path)
    state = make_state()
    assert ck.snapshot_memory(5, state, {})
    state["model"]["layer0.weight"].add_(1)
    monkeypatch.setattr(C, "MEMORY_BUDGET", 1.0)  # any snapshot cost is affordable
    time.sleep(ck._memory_cost * 1.1)
    assert ck.snapshot_memory(10, state, {})
    assert ck.memory[0] == 10
    assert D.same_bytes(ck.memory[1]["model"]["layer0.weight"], state["model"]["layer0.weight"])
    monkeypatch.setattr(C, "MEMORY_BUDGET", 1e-9)  # now nothing is: the next one is skipped
    assert not ck.snapshot_memory(15, state, {}) and ck.memory[0] == 10
    ck.close()


def test_close_ends_the_writer_thread_so_the_host_copies_are_freed_by_the_caller_not_at_exit(tmp_path):
    """A writer thread still ending when the interpreter finalises frees the checkpointer's host
    copies there, and torch's deallocator aborts the process (SIGABRT after every save landed,
    seen in a host process under load). close() waits for the thread: what it held is freed
    by the thread that drops the checkpointer."""
    import weakref

    ck, _ = checkpointer(tmp_path)
    ck.save_durable_async(1, make_state(), {"train/loss": 1.0})
    ck.close()
    assert not ck._writer.is_alive()
    freed_on = []
    weakref.finalize(ck, lambda: freed_on.append(threading.current_thread().name))
    del ck
    assert freed_on == [threading.current_thread().name]


def test_close_ends_the_writer_thread_after_a_failed_write_too_and_a_second_close_returns(tmp_path):
    store = open_store((tmp_path / "store").as_uri())
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "j").write_text("a file where the job's directory goes")
    ck, _ = checkpointer(tmp_path, store)
    ck.save_durable_async(1, make_state(), {"train/loss": 1.0})
    with pytest.raises(NotADirectoryError):
        ck.close()
    assert not ck._writer.is_alive()
    ck.close()  # nothing queued, nothing raised again, nothing left waiting
