"""The checkpoint watcher of command workloads, on real files, with a clock the test moves."""
import pytest

from orbit_dagster.runtime.watcher import CheckpointWatcher, PatternError


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def watcher(tmp_path, **kw):
    clock, logged = Clock(), []
    w = CheckpointWatcher(tmp_path, clock=clock, log=logged.append, **{"settle_seconds": 2.0, **kw})
    return w, clock, logged


def steps(found):
    return [(f.name, f.step, f.layout) for f in found]


def test_a_file_written_slowly_is_registered_only_once_it_settles(tmp_path):
    w, clock, _ = watcher(tmp_path)
    f = tmp_path / "ckpt_10.pt"
    for _ in range(5):  # a write every second: never 2 s unchanged
        with open(f, "ab") as fh:
            fh.write(b"x" * 100)
        assert w.poll() == []
        clock.now += 1.0
    assert w.poll() == []  # 1 s since the last write
    clock.now += 1.5
    assert steps(w.poll()) == [("ckpt_10.pt", 10, "file")]
    clock.now += 10
    assert w.poll() == []  # once


def test_a_directory_without_its_marker_is_not_registered(tmp_path):
    w, clock, _ = watcher(tmp_path, complete_marker=".orbit-complete")
    d = tmp_path / "checkpoint-100"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"w" * 10)
    w.poll()
    clock.now += 60
    assert w.poll() == []  # settled long ago, but the framework has not said it is done
    (d / ".orbit-complete").write_text("")
    assert w.poll() == []  # the marker changed the listing: it settles again
    clock.now += 2.5
    assert steps(w.poll()) == [("checkpoint-100", 100, "dir")]


def test_a_sharded_checkpoint_waits_for_its_metadata_without_a_marker_in_the_template(tmp_path):
    w, clock, _ = watcher(tmp_path)
    d = tmp_path / "ckpt_20"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"rank 0 shard")
    (d / "__1_0.distcp").write_bytes(b"rank 1 shard")
    w.poll()
    clock.now += 60
    assert w.poll() == []  # every rank's shards settled, the coordinator's metadata not yet written
    (d / ".metadata").write_bytes(b"plan")
    w.poll()
    clock.now += 2.5
    assert steps(w.poll()) == [("ckpt_20", 20, "dir")]


def test_a_file_checkpoint_waits_for_its_sibling_marker_which_is_no_checkpoint(tmp_path):
    w, clock, _ = watcher(tmp_path, complete_marker=".orbit-complete")
    (tmp_path / "step-7.ckpt").write_bytes(b"x")
    w.poll()
    clock.now += 5
    assert w.poll() == []
    (tmp_path / "step-7.ckpt.orbit-complete").write_text("")
    clock.now += 5
    assert steps(w.poll()) == [("step-7.ckpt", 7, "file")]


def test_the_same_step_twice_is_registered_once(tmp_path):
    w, clock, logged = watcher(tmp_path)
    (tmp_path / "ckpt_5.pt").write_bytes(b"a")
    w.poll()
    clock.now += 3
    assert [f.step for f in w.poll()] == [5]
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "x.bin").write_bytes(b"b")
    w.poll()
    clock.now += 3
    assert w.poll() == [] and any("step 5 is registered already" in m for m in logged)


@pytest.mark.parametrize("name", [".ckpt_10.pt.tmp", "tmp_ckpt_10.pt", "ckpt_10.pt.tmp", "ckpt_10.partial",
                                  ".hidden-3", "ckpt_10.txt", "notes", "ckpt_x.pt"])
def test_temporary_and_foreign_names_are_never_checkpoints(tmp_path, name):
    w, clock, _ = watcher(tmp_path, settle_seconds=0)
    (tmp_path / name).write_bytes(b"x")
    clock.now += 10
    assert w.poll() == [] and w.poll() == []


@pytest.mark.parametrize("name, step", [("checkpoint-100", 100), ("ckpt_100.pt", 100), ("step-100.ckpt", 100),
                                        ("model_3.safetensors", 3), ("epoch=1-step_42.pth", 42), ("w-9.bin", 9)])
def test_the_default_pattern_takes_the_step_from_the_name(tmp_path, name, step):
    w, clock, _ = watcher(tmp_path)
    (tmp_path / name).write_bytes(b"x")
    w.poll()
    clock.now += 3
    assert [f.step for f in w.poll()] == [step]


def test_a_pattern_of_the_template_chooses_the_names(tmp_path):
    w, clock, _ = watcher(tmp_path, pattern=r"^weights\.(?P<step>\d+)$")
    (tmp_path / "weights.12").write_bytes(b"x")
    (tmp_path / "ckpt_13.pt").write_bytes(b"x")
    w.poll()
    clock.now += 3
    assert [f.step for f in w.poll()] == [12]


def test_a_pattern_without_a_step_group_is_refused(tmp_path):
    with pytest.raises(PatternError):
        CheckpointWatcher(tmp_path, pattern=r"^ckpt_(\d+)$")


def test_after_a_kill_only_what_had_settled_counts(tmp_path):
    w = CheckpointWatcher(tmp_path, settle_seconds=30, log=lambda m: None)  # the real clock
    (tmp_path / "ckpt_1.pt").write_bytes(b"x")
    w.poll()
    assert w.settle_after_exit(killed=True) == []
    clean = CheckpointWatcher(tmp_path, settle_seconds=30, log=lambda m: None)
    assert [f.step for f in clean.settle_after_exit(killed=False, recheck_s=0.05)] == [1]


def test_a_node_of_a_group_takes_its_shards_without_the_metadata_another_node_holds(tmp_path):
    w, clock, _ = watcher(tmp_path, metadata_elsewhere=True)
    d = tmp_path / "ckpt_20"
    d.mkdir()
    (d / "__1_0.distcp").write_bytes(b"rank 1 shard")  # rank 0, and .metadata, are on another host
    w.poll()
    clock.now += 2.5
    assert steps(w.poll()) == [("ckpt_20", 20, "dir")]
