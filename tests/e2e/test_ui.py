"""The Dagster UI, in a real headless Chromium: checkpoint -> evaluation -> best_checkpoint
lineage with the demo's partitions filled; the server listens on 127.0.0.1 only."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from orbit_dagster.deploy.instance import environment

pytestmark = pytest.mark.e2e
CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def webserver(demo_run):
    settings, _ = demo_run
    port = free_port()
    exe = str(Path(sys.executable).with_name("dagster-webserver"))
    proc = subprocess.Popen([exe, "-h", "127.0.0.1", "-p", str(port), "-m", "orbit_dagster.definitions"],
                            env=environment(settings), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/server_info", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("dagster-webserver did not answer within 90 s")
    yield url, port
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs it with apt-get when it may)")
def test_lineage_page_shows_the_filled_partitions(webserver, demo_run, tmp_path):
    from playwright.sync_api import sync_playwright

    url, port = webserver
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1920, "height": 1080})
        page.goto(f"{url}/assets/evaluation?view=lineage&lineageDepth=2", wait_until="networkidle")
        page.get_by_text("best_checkpoint", exact=True).first.wait_for(timeout=60_000)
        page.get_by_text("4 partitions").first.wait_for(timeout=30_000)
        # Each node loads its partition status on its own: wait until they all have.
        page.get_by_text("100% filled").nth(2).wait_for(timeout=60_000)
        text = page.inner_text("body")
        page.screenshot(path=str(tmp_path / "lineage.png"))
        browser.close()
    for node in ("training_run", "checkpoint", "evaluation", "best_checkpoint"):
        assert node in text
    assert text.count("100% filled") >= 3  # training_run, checkpoint, evaluation, best_checkpoint partitions


def test_asset_graph_edges_over_graphql(webserver):
    import json

    url, _ = webserver
    query = '{ assetNodes { assetKey { path } dependencyKeys { path } } }'
    req = urllib.request.Request(url + "/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    nodes = json.load(urllib.request.urlopen(req, timeout=30))["data"]["assetNodes"]
    deps = {n["assetKey"]["path"][0]: {d["path"][0] for d in n["dependencyKeys"]} for n in nodes}
    assert deps["checkpoint"] == {"training_run"}
    assert deps["evaluation"] == {"checkpoint"}
    assert deps["best_checkpoint"] == {"evaluation"}


def test_ui_listens_on_loopback_only(webserver):
    _, port = webserver
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout \
        if shutil.which("ss") else Path("/proc/net/tcp").read_text()
    if shutil.which("ss"):
        assert out.strip() and all("127.0.0.1:" in line for line in out.strip().splitlines())
    else:
        listening = [row.split() for row in out.splitlines()[1:] if row.split()[3] == "0A"]
        ours = [row for row in listening if int(row[1].split(":")[1], 16) == port]
        assert ours and all(row[1].startswith("0100007F:") for row in ours)
