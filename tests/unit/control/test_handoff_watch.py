"""The sensor's watch over handed-off attempts (one function, a stand-in event stream; the
whole hand-off on the real sim market is tests/integration/test_handoff.py)."""
import time

from orbit_dagster.control.handoff import COLLECT_EVERY_S, Watch
from orbit_dagster.core.errors import ProviderError
from orbit_dagster.core.host_contract import Checkpoint, Exit, Metrics, Progress, Rejected

EXIT = Exit(code=0, failure_class=None, reason="completed", seconds=1.0)


class Stream:
    """An attempt's event stream as `provider.read_events` serves it: (events, new offset)."""

    def __init__(self):
        self.events: list = []
        self.reads: list[int] = []
        self.fail = False

    def read_events(self, handle, offset):  # noqa: ARG002
        self.reads.append(offset)
        if self.fail:
            raise ProviderError("host out of reach", retryable=True)
        return self.events[offset:], len(self.events)


def row(offset=0, age=1.0):
    return {"run_id": "j/1", "handed_off_at": time.time() - age, "follow_offset": offset}


def test_metrics_alone_wake_no_run_the_end_does_a_checkpoint_after_a_while():
    watch, stream = Watch(), Stream()
    stream.events += [Metrics(step=1, values={}), Progress(step=2)]
    assert watch.wants_run(stream, row(), None, every_s=300) is None
    stream.events.append(Checkpoint(step=3, tier="durable", uri="file:///s/j/step-3", sha256="0" * 64, bytes=1, attempt=1))
    # A checkpoint written soon after the last run read the stream waits for more to batch...
    assert watch.wants_run(stream, row(age=1), None, every_s=300) is None
    # ... and wakes a run once COLLECT_EVERY_S have passed.
    assert watch.wants_run(stream, row(age=COLLECT_EVERY_S + 1), None, every_s=300) == "it wrote a checkpoint"
    assert stream.reads == [0, 2, 3]  # each line read once
    # A run took it up and handed it back at offset 3: the watch reads on from there.
    stream.events.append(Metrics(step=4, values={"train/loss": 1.0}))
    assert watch.wants_run(stream, row(offset=3, age=1), None, every_s=300) is None
    stream.events.append(EXIT)
    assert watch.wants_run(stream, row(offset=3, age=1), None, every_s=300) == "its workload ended"  # at once
    assert stream.reads[-2:] == [3, 4]
    assert watch.wants_run(stream, row(offset=3, age=1), None, every_s=300)  # still, until a run takes it up
    assert stream.reads[-1] == 4  # and the stream is not read again


def test_the_clock_wakes_a_run_and_an_unreachable_host_does_not():
    watch, stream = Watch(), Stream()
    assert watch.wants_run(stream, row(age=301), None, every_s=300).startswith("no run has read its events")
    stream.fail = True
    assert watch.wants_run(stream, row(), None, every_s=300) is None


def test_attempts_no_longer_handed_off_are_forgotten():
    watch, stream = Watch(), Stream()
    stream.events.append(EXIT)
    assert watch.wants_run(stream, row(), None, every_s=300)
    watch.forget(set())
    stream.events.clear()
    assert watch.wants_run(stream, row(), None, every_s=300) is None  # read afresh from its offset


def test_a_refused_line_wakes_no_run_even_one_that_says_it_is_an_exit():
    watch, stream = Watch(), Stream()
    stream.events.append(Rejected(0, "exit: contract version 9 is not one this control plane reads (1)",
                                  '{"type": "exit", "contract": 9}', kind="exit"))
    assert watch.wants_run(stream, row(age=COLLECT_EVERY_S + 1), None, every_s=300) is None
