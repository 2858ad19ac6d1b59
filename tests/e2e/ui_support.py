"""What the browser tests of the Dagster UI share: one real daemon and `dagster-webserver`
over a fresh $ORBIT_HOME, a Chromium page, and the few UI gestures the flows repeat
(fill a launchpad, wait for a run). Waits are generous (two CPU cores, shared) but bounded."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from orbit_dagster.deploy.instance import Daemon, dagster_instance, environment
from orbit_dagster.settings import Settings
from tests import helpers

CHROMIUM = shutil.which("chromium")
# Playwright's own browser download does not work everywhere: drive the system's Chromium.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
LOCATION = "orbit_dagster.definitions"  # the code location's name: the module `-m` loads
# The launchpad shows the template enum by member name: a template's `-` becomes `_`.
TEMPLATE = "charlm_finetune"
# A small job: two checkpoints (a1/8, a1/16), two evaluations that run side by side.
SMALL = ["config.steps=16", "checkpoint.every_steps=8", "checkpoint.interval_policy=fixed"]
# A long one, checkpointed as often, to be cancelled once it has a few checkpoints.
LONG = ["config.steps=5000", "checkpoint.every_steps=8", "checkpoint.interval_policy=fixed"]
SECOND = 1000  # Playwright counts milliseconds
REPO = Path(__file__).resolve().parents[2]
REDACT_JS = """pairs => {
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walk.nextNode(); node; node = walk.nextNode()) {
    let text = node.nodeValue;
    for (const [from, to] of pairs) text = text.split(from).join(to);
    if (text !== node.nodeValue) node.nodeValue = text;
  }
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class UI:
    """The stack under test and the browser page driving it."""

    url: str
    settings: Settings
    instance: object  # the same DagsterInstance the daemon and webserver use
    page: object
    shots: Path
    state: dict = field(default_factory=dict)  # what one flow leaves for the next (the trained job)

    def goto(self, path: str) -> None:
        self.page.goto(self.url + path, wait_until="domcontentloaded")

    def shot(self, name: str) -> Path:
        """A screenshot of the viewport; into docs/img when $ORBIT_UI_SHOTS says so. Paths of
        the machine that took it (the checkout, the virtualenv, the test's home) are written
        as `<venv>`, `<checkout>` and `$ORBIT_HOME` first: the pictures are for anyone."""
        pairs = [(sys.prefix, "<venv>"), (str(REPO), "<checkout>"), (str(self.settings.home), "$ORBIT_HOME")]
        self.page.evaluate(REDACT_JS, pairs)
        path = self.shots / name
        self.page.screenshot(path=str(path))
        return path

    def text(self) -> str:
        return self.page.inner_text("body")

    def see(self, text: str, *, timeout_s: float = 60, exact: bool = False) -> None:
        self.page.get_by_text(text, exact=exact).first.wait_for(timeout=timeout_s * SECOND)

    # -- the launchpad -------------------------------------------------------------------
    def open_launchpad(self, job: str) -> None:
        self.goto(f"/locations/{LOCATION}/jobs/{job}/playground")
        self.page.get_by_role("button", name="Launch Run").wait_for(timeout=90 * SECOND)
        self.page.locator(".CodeMirror").first.wait_for(timeout=30 * SECOND)

    def write_config(self, yaml: str) -> None:
        """Replace the launchpad's YAML the way a person does: select all, type (paste) anew."""
        self.page.locator(".CodeMirror").first.click()
        self.page.keyboard.press("Control+A")
        self.page.keyboard.insert_text(yaml)
        helpers.wait_for(lambda: self.page.evaluate("document.querySelector('.CodeMirror').CodeMirror.getValue()")
                         .strip() == yaml.strip(), timeout=10, what="the launchpad's editor to hold the new config")

    def choose_partition(self, key: str) -> None:
        box = self.page.get_by_placeholder("Partition")
        option = self.page.get_by_text(key, exact=True).first
        for _ in range(3):
            # Typed again when no suggestion shows: text typed before the page has loaded the
            # partitions (a loaded machine) filters an empty list and is not filtered again.
            box.click()
            box.fill("")
            box.fill(key.split("|")[0])
            try:
                option.wait_for(timeout=30 * SECOND)
                break
            except PlaywrightTimeout:
                self.page.keyboard.press("Escape")
        option.click()
        helpers.wait_for(lambda: box.input_value() == key, timeout=10, what=f"partition {key} chosen")

    def launch(self) -> str:
        """Click Launch Run; return the new run's id (the UI opens the run's page)."""
        self.page.get_by_role("button", name="Launch Run").click()
        self.page.wait_for_url(re.compile(r".*/runs/[0-9a-f-]{36}.*"), timeout=60 * SECOND)
        return re.search(r"/runs/([0-9a-f-]{36})", self.page.url).group(1)

    # -- runs, as the instance records them ---------------------------------------------------
    def run(self, run_id: str):
        return self.instance.get_run_by_id(run_id)

    def wait_run(self, run_id: str, *statuses: str, timeout_s: float = 300):
        """Wait until the run reaches one of `statuses` (DagsterRunStatus names); return it."""
        ended = {"SUCCESS", "FAILURE", "CANCELED"}

        def done():
            run = self.run(run_id)
            if run is not None and run.status.value in ended | set(statuses):
                return run
            return None

        run = helpers.wait_for(done, timeout=timeout_s, every=1.0, what=f"run {run_id} to reach {statuses}")
        assert run.status.value in statuses, f"run {run_id} is {run.status.value}, expected {statuses}: " \
                                             f"{self.failure_of(run_id)}"
        return run

    def runs(self, **tags: str) -> list:
        import dagster as dg

        return [r.dagster_run for r in self.instance.get_run_records(dg.RunsFilter(tags=tags))]

    def failure_of(self, run_id: str) -> str:
        """The messages of the run's step failures (what its page shows in red)."""
        out = []
        for entry in self.instance.all_logs(run_id):
            event = entry.dagster_event
            if event is not None and event.event_type_value == "STEP_FAILURE":
                out.append(event.event_specific_data.error.message)
        return "\n".join(out)

    def sensor_status(self, name: str) -> str | None:
        for state in self.instance.all_instigator_state():
            if state.name == name:
                return state.status.value
        return None


def submit_config(overrides: list[str], experiment: str) -> str:
    return "\n".join(["ops:", "  submit_op:", "    config:", f"      template: {TEMPLATE}",
                      f"      overrides: {json.dumps(overrides)}", f"      experiment: {experiment}", ""])


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"dagster-webserver exited with {proc.returncode} before answering")
        try:
            urllib.request.urlopen(url + "/server_info", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"dagster-webserver did not answer within {timeout_s:.0f} s")


@contextmanager
def orbit_stack(home: Path) -> Iterator[tuple[str, Settings]]:
    """A Dagster daemon (sensors launch the runs) and the webserver, on 127.0.0.1, over `home`,
    with the embedded market reclaiming nothing; everything they started is ended after."""
    from tests.conftest import kill_processes_under

    quiet = {"ORBIT_HOME": str(home), "ORBIT_SIM_RECLAIMS": "none"}
    unset = ("ORBIT_SIM_TRACES", "ORBIT_SIM_SCALE", "ORBIT_SIM_NOTICE_SECONDS", "ORBIT_CHECKPOINT_STORE",
             "ORBIT_TEMPLATES")
    with pytest.MonkeyPatch.context() as mp:  # the children copy the environment when they start
        for k, v in quiet.items():
            mp.setenv(k, v)
        for k in unset:
            mp.delenv(k, raising=False)
        settings = Settings.from_env(home)
        # Create the instance's SQLite storages here, once: three processes creating them at
        # the same moment can stamp a schema table twice ("more than one head present").
        with dagster_instance(settings) as instance:
            instance.get_run_records(limit=1)
        daemon = Daemon(settings).start()
        port = free_port()
        env = environment(settings)
    exe = str(Path(sys.executable).with_name("dagster-webserver"))
    log = open(Path(env["DAGSTER_HOME"]) / "webserver.log", "ab")
    web = subprocess.Popen([exe, "-h", "127.0.0.1", "-p", str(port), "-m", LOCATION], env=env, stdout=log,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url, web, 120)
        yield url, settings
    finally:
        try:
            os.killpg(web.pid, signal.SIGTERM)
            web.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(web.pid, signal.SIGKILL)
        daemon.stop()
        log.close()
        kill_processes_under(home)  # sim hosts and their workloads outlive the runs that rented them


@contextmanager
def chromium_page() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1920, "height": 1080})
            page.set_default_timeout(60 * SECOND)
            yield page
        finally:
            browser.close()
