"""One real Dagster instance (daemon and sensors ticking) shared by the end-to-end tests."""
import pytest

from orbit_dagster.cli.demo import run_demo
from orbit_dagster.settings import Settings

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

