"""The web dashboard end to end: a real mesh (real etcd, real agents), a workflow
submitted through the CLI, and Debian's headless Chromium driven by Selenium
watching it progress, opening a task's log and the nodes' gossip state."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from hypermesh.chunkfs.store import S3Store
from hypermesh.local.agents import AgentProcess
from hypermesh.local.registry import Registry
from tests.conftest import Mesh
from tests.ops.test_telemetry import SPIN
from tests.tasks.test_data_tasks import _dataset
from tests.tasks.test_images import Pushed

GATED = "until [ -f gate ]; do sleep 0.05; done"


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    assert chromium and driver_path, (
        "the dashboard test needs Debian's chromium and chromium-driver (scripts/setup.sh)"
    )
    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def shown(css: str) -> Callable[[WebDriver], bool]:
    return lambda d: bool(d.find_elements(By.CSS_SELECTOR, css))


def text_of(driver: WebDriver, css: str) -> str:
    """The first match's text; "" when none, or when the page re-rendered it between
    finding and reading (tables are rebuilt on every poll): the wait asks again."""
    found = driver.find_elements(By.CSS_SELECTOR, css)
    try:
        return found[0].text if found else ""
    except StaleElementReferenceException:
        return ""


def test_dashboard_shows_a_workflow_progress_and_a_task_log(
    mesh: Mesh, browser: WebDriver
) -> None:
    node = mesh.agent("node1", slots=2)
    mesh.agent("node2", slots=2)
    recipe = mesh.write_recipe(
        f"""
name: dash
experiments:
  prep:
    parameters: {{shard: {{values: [0, 1]}}}}
    command: ["echo started-{{{{shard}}}}", "{GATED}", "echo finished-{{{{shard}}}}"]
  report: {{after: [prep], command: ["echo report-done"]}}
"""
    )
    wid = mesh.submit(recipe)
    browser.get(f"http://{node.http_address}/")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    wait.until(shown(f'[data-wid="{wid}"]'))
    browser.find_element(By.CSS_SELECTOR, f'[data-wid="{wid}"]').click()
    # The DAG shows both experiments; prep runs (held at the gate), report waits.
    wait.until(shown('g[data-exp="prep"][data-state="running"]'))
    assert browser.find_elements(By.CSS_SELECTOR, 'g[data-exp="report"][data-state="pending"]')
    task = f"{wid}.prep.0"
    wait.until(shown(f'tr[data-task="{task}"][data-state="running"]'))
    browser.find_element(By.CSS_SELECTOR, f'tr[data-task="{task}"]').click()
    wait.until(lambda d: "started-0" in text_of(d, "#log"))  # live, from the running attempt
    (mesh.root / "gate").touch()
    wait.until(shown('g[data-exp="report"][data-state="succeeded"]'))
    wait.until(lambda d: "succeeded" in text_of(d, f'[data-wid="{wid}"] .state'))
    wait.until(lambda d: "finished-0" in text_of(d, "#log"))  # the rest arrived as it ran
    assert text_of(browser, "#log").count("\nstarted-0\n") == 1  # appended, not re-sent
    browser.find_element(By.CSS_SELECTOR, f'tr[data-task="{wid}.report.0"]').click()
    wait.until(lambda d: "report-done" in text_of(d, "#log"))
    assert "succeeded" in text_of(browser, '#attempts tr[data-attempt="1"]')
    # Nodes with their gossip state, and the chunk-cache map (one row per node).
    wait.until(lambda d: "alive" in text_of(d, 'tr[data-node="node2"]'))
    leader = next(n["name"] for n in mesh.hm_json("nodes") if n["leader"])
    wait.until(lambda d: "★" in text_of(d, f'tr[data-node="{leader}"]'))
    assert browser.find_elements(By.CSS_SELECTOR, 'tr[data-cache="node2"]')
    assert mesh.hm_json("status", wid)["state"] == "succeeded"


def test_dashboard_endpoints_answer_json(mesh: Mesh) -> None:
    node = mesh.agent("node1")
    wid = mesh.submit(mesh.write_recipe('experiments:\n  say: {command: ["echo hi-json"]}\n'),
                      "--wait")

    def get(path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://{node.http_address}{path}", timeout=10) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    status, body = get("/api/workflows")
    assert status == 200 and body["workflows"][0] == mesh.hm_json("status", wid)
    status, body = get(f"/api/workflows/{wid}")
    assert status == 200 and body["tasks"] == mesh.hm_json("tasks", wid)
    assert body["dag"] == [{"name": "say", "after": [], "workers": None, "cancelled": False,
                            "extra_samples": 0, "env": {}, "pass_env": []}]
    status, body = get(f"/api/logs/{wid}.say.0")
    assert status == 200 and "hi-json" in body["text"] and body["running"] is False
    offset = body["offset"]
    assert get(f"/api/logs/{wid}.say.0?offset={offset}")[1]["text"] == ""
    assert get("/api/workflows/nope-1")[0] == 404
    assert get("/api/logs/nope")[0] == 400
    assert get(f"/api/logs/{wid}.say.0?attempt=9")[0] == 404
    status, body = get("/api/nodes")
    assert status == 200 and body["nodes"][0]["name"] == "node1"
    assert body["nodes"][0]["http"] == node.http_address


def test_a_node_that_watches_its_own_part_shows_every_task_of_a_block(mesh: Mesh) -> None:
    """``--watch own``: the follower's mirror has no block, so its dashboard reads the
    namespace from etcd on request, and shows what the leader's shows."""
    nodes = [mesh.agent(n, slots=2, extra=("--watch", "own")) for n in ("node1", "node2")]
    leader = next(n["name"] for n in mesh.hm_json("nodes") if n["leader"])
    follower = next(n for n in nodes if n.name != leader)
    wid = mesh.submit(mesh.write_recipe(
        'experiments:\n  say:\n    samples: 6\n    batch: 2\n'
        '    command: ["echo hi-{{task_index}}"]\n'), "--wait")

    def get(node: AgentProcess, path: str) -> dict:
        try:
            with urllib.request.urlopen(f"http://{node.http_address}{path}", timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path}: {exc.code} {exc.read()!r}") from exc

    tasks = mesh.hm_json("tasks", wid)
    assert len(tasks) == 6 and all(t["state"] == "succeeded" for t in tasks)
    shown = get(follower, f"/api/workflows/{wid}")
    assert shown["tasks"] == tasks
    assert shown["status"]["state"] == "succeeded"
    ran_here = next(t for t in tasks if t["node"] == follower.name)
    log = get(follower, f"/api/logs/{wid}.say.{ran_here['index']}")
    assert f"hi-{ran_here['index']}" in log["text"]
    # The CLI finds a block task's attempt in the block's batches too.
    for t in tasks:
        out = mesh.hm("logs", f"{wid}.say.{t['index']}", check=True)
        assert f"hi-{t['index']}" in out.stdout


def test_dashboard_says_why_tasks_no_live_node_can_run_wait(
    mesh: Mesh, browser: WebDriver
) -> None:
    node = mesh.agent("node1", slots=1)
    recipe = mesh.write_recipe(
        "experiments:\n  train: {samples: 2, hardware: {gpu: k80}, command: ['true']}\n"
    )
    wid = mesh.submit(recipe)
    why = "no live node has gpu k80 (0 of 1 nodes match)"
    browser.get(f"http://{node.http_address}/")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    wait.until(lambda d: text_of(d, f'[data-wid="{wid}"] [data-waiting="train"]') == why)
    browser.find_element(By.CSS_SELECTOR, f'[data-wid="{wid}"]').click()
    wait.until(lambda d: why in text_of(d, f'tr[data-task="{wid}.train.1"]'))
    title = browser.find_element(By.CSS_SELECTOR, 'g[data-exp="train"] title')
    assert title.get_attribute("textContent") == why  # the DAG box's tooltip


def test_a_taken_dashboard_port_fails_the_agent_start(mesh: Mesh) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot serve the dashboard on 127.0.0.1:{port}"):
            mesh.agent("node1", extra=("--http-listen", f"127.0.0.1:{port}"))
    bad = mesh.hm("agent", "start", "--http-listen", "nowhere")
    assert bad.returncode == 2 and "--http-listen 'nowhere': expected HOST:PORT" in bad.stderr


def test_dashboard_nodes_show_telemetry_of_a_busy_task(mesh: Mesh, browser: WebDriver) -> None:
    node = mesh.agent("node1", extra=("--telemetry-period", "0.5"))
    mesh.agent("node2", extra=("--telemetry-period", "0.5"))
    wid = mesh.submit(mesh.write_recipe(SPIN))
    task = f"{wid}.spin.0"
    try:
        browser.get(f"http://{node.http_address}/")
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)

        def busy(d: WebDriver) -> str:
            """The busy task's node, once its row shows the task's CPU (> 30 % of a core)
            and the node's own CPU figure."""
            usage = d.find_elements(By.CSS_SELECTOR, f'tr[data-usage="{task}"]')
            try:
                if not usage or float(usage[0].get_attribute("data-cpu") or 0) <= 30:
                    return ""
                where = usage[0].find_elements(By.CSS_SELECTOR, "td")[2].text
                cpu = d.find_elements(By.CSS_SELECTOR, f'tr[data-node="{where}"] .cpu')
                return where if cpu and float(cpu[0].get_attribute("data-cpu") or 0) > 0 else ""
            except StaleElementReferenceException:
                return ""

        where = wait.until(busy)
        assert where in ("node1", "node2")
        assert "CPU " in text_of(browser, f'tr[data-node="{where}"] .cpu')
        assert "mem " in text_of(browser, f'tr[data-node="{where}"] td.telemetry')
        # Both nodes answer: the page's own agent from memory, the other over gRPC.
        for name in ("node1", "node2"):
            wait.until(shown(f'tr[data-node="{name}"] td.telemetry .cpu'))
    finally:
        mesh.hm("cancel", wid)
    # A node that does not answer (stopped) shows no telemetry and holds nothing up.
    stalled = mesh.agents["node2"].proc
    assert stalled is not None
    stalled.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with urllib.request.urlopen(f"http://{node.http_address}/api/nodes", timeout=10) as r:
            rows = {row["name"]: row for row in json.load(r)["nodes"]}
        took = time.monotonic() - started
    finally:
        stalled.send_signal(signal.SIGCONT)
    assert took < 3, f"/api/nodes took {took:.1f} s with a stopped node"
    assert rows["node2"]["telemetry"] is None and rows["node2"]["task_usage"] == []
    assert rows["node1"]["telemetry"]["memory_total_bytes"] > 0


def test_dashboard_cache_map_after_a_data_read(
    mesh: Mesh, browser: WebDriver, store: S3Store, store_url: str, tmp_path: Path
) -> None:
    _dataset(store, tmp_path)
    extra = ("--store", store_url, "--cache-size", "256MiB")
    node = mesh.agent("node1", extra=extra)
    mesh.agent("node2", extra=extra)
    recipe = mesh.write_recipe(
        'experiments:\n  read:\n    data: {toy: toy}\n'
        '    command: [\'cat "$HM_DATA_TOY/shard-0/part.txt"\']\n'
    )
    wid = mesh.submit(recipe)
    mesh.wait_state(wid, {"succeeded"}, timeout=90)
    (task,) = mesh.hm_json("tasks", wid)
    reader = task["node"]
    part = len("hello from shard 0\n")
    browser.get(f"http://{node.http_address}/")
    wait = WebDriverWait(browser, 40, poll_frequency=0.2)
    row = f'tr[data-cache-set="{reader}/toy"]'

    def cached(d: WebDriver) -> bool:
        """The reader's cache of toy holds part.txt's bytes, read cold from the store
        (its blocks by source come with the cache's records, a moment apart)."""
        found = d.find_elements(By.CSS_SELECTOR, row)
        try:
            held = bool(found) and int(found[0].get_attribute("data-bytes") or 0) == part
        except StaleElementReferenceException:
            return False
        return held and "store 100%" in text_of(d, f"{row} .hits")

    wait.until(cached)
    wait.until(lambda d: "store 100%" in text_of(d, f'tr[data-cache="{reader}"] .hits'))
    assert "19 B" in text_of(browser, f'tr[data-cache="{reader}"]')
    other = "node2" if reader == "node1" else "node1"
    assert not browser.find_elements(By.CSS_SELECTOR, f'tr[data-cache-set^="{other}/"]')
    # The same figures in top --json, from the reader's GetTelemetry.
    (top,) = mesh.hm_json("top", "--node", reader)
    (usage,) = top["telemetry"]["caches"]
    assert usage["dataset"] == "toy" and usage["cached_bytes"] == part
    assert usage["store_blocks"] >= 1 and usage["cache_blocks"] == usage["peer_blocks"] == 0


def test_dashboard_says_an_image_is_being_pulled_while_the_registry_is_down(
    mesh: Mesh, browser: WebDriver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Registry(tmp_path / "registry") as registry:  # the test's own: it pauses it
        monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registry.registries_conf()))
        images = Pushed(registry, tmp_path)
        try:
            ref = images.tiny("dash", runnable=True)
            node = mesh.agent("node1", slots=1)
            registry.pause()
            wid = mesh.submit(mesh.write_recipe(
                f"experiments:\n  train: {{image: {ref}, command: ['echo in image']}}\n"))
            why = f"pulling image {ref} on node1"
            browser.get(f"http://{node.http_address}/")
            wait = WebDriverWait(browser, 30, poll_frequency=0.2)
            wait.until(lambda d: text_of(d, f'[data-wid="{wid}"] [data-waiting="train"]') == why)
            registry.resume()
            assert mesh.wait_state(wid, {"succeeded", "failed"})["state"] == "succeeded"
            wait.until(lambda d: not d.find_elements(
                By.CSS_SELECTOR, f'[data-wid="{wid}"] [data-waiting="train"]'))
        finally:
            registry.resume()
            images.remove()
