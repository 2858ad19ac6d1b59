import pytest

from orbit_dagster.core.errors import InvalidTransition
from orbit_dagster.core.lifecycle import TRANSITIONS, JobState, check_transition

S = JobState


@pytest.mark.parametrize("current,new", [(a, b) for a in S for b in sorted(TRANSITIONS[a], key=lambda s: s.value)])
def test_every_edge_in_the_table_is_legal(current, new):
    check_transition(current, new)


@pytest.mark.parametrize("current,new", [(a, b) for a in S for b in S if b not in TRANSITIONS[a]])
def test_every_other_edge_raises(current, new):
    with pytest.raises(InvalidTransition) as err:
        check_transition(current, new, job_id="j1")
    assert current.value in str(err.value) and new.value in str(err.value)


def test_lost_recovers_through_queued_only():
    assert TRANSITIONS[S.LOST] == {S.QUEUED, S.FAILED}
    with pytest.raises(InvalidTransition):
        check_transition(S.LOST, S.RUNNING)


def test_a_new_job_starts_created():
    check_transition(None, S.CREATED)
    with pytest.raises(InvalidTransition):
        check_transition(None, S.QUEUED)
