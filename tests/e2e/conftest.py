"""One real Dagster instance (daemon and sensors ticking) shared by the end-to-end tests."""
import pytest

from orbit_dagster.control.settings import Settings
from orbit_dagster.demo import run_demo

# Small enough for CI, large enough for four checkpoints and their evaluations.
E2E_OVERRIDES = {"config.steps": 48, "checkpoint.every_steps": 12}


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The demo without reclaims: training, checkpoints, evaluations, ranking, cost."""
    home = tmp_path_factory.mktemp("e2e") / "orbit-home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORBIT_HOME", str(home))
        settings = Settings.from_env(home)
        result = run_demo(settings, overrides=E2E_OVERRIDES, experiment="e2e", reclaims=False, timeout_s=900)
    return settings, result


def pytest_collection_modifyitems(items):
    # One xdist worker runs every end-to-end test, in file order: they share the demo run, and
    # two Dagster daemons at once would starve each other on a 2-core machine.
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.xdist_group("e2e"))
