"""When training went on past a checkpoint (where a lost attempt's waste begins), read from its
event at registration."""
from orbit_dagster.control.checkpoints import trained_at
from orbit_dagster.core.host_contract import Checkpoint


def test_when_training_went_on_past_a_checkpoint_is_read_from_its_event():
    def ev(**kw):
        return Checkpoint(step=10, tier="durable", uri="file:///x", sha256="ab", bytes=1, attempt=1, ts=1000.0, **kw)

    # An SDK async save: 0.2 s of its 3 s were the training thread's; training went on 2.8 s before durable.
    assert trained_at(ev(save_seconds=3.0, blocked_seconds=0.2, write_seconds=2.9)).timestamp() == 997.2
    assert trained_at(ev(save_seconds=3.0, blocked_seconds=3.0)).timestamp() == 1000.0  # a sync save
    assert trained_at(ev(write_seconds=8.0)).timestamp() == 992.0  # a script's files, then the agent's upload
    for bad in (dict(), dict(write_seconds=float("nan")), dict(write_seconds=-1.0),
                dict(save_seconds=1.0, blocked_seconds=2.0)):
        assert trained_at(ev(**bad)) is None, bad  # unknown: the durable time stands
