"""The dashboard's trials view after a real search: 8 trials on a real mesh reporting
``HM_METRIC`` lines step by step, five complete, two pruned by the median pruner and one
failing. The JSON endpoint is checked against ``hypermesh best --json``, then Debian's
headless Chromium shows the view: the sortable table, the curves chart and the parallel
coordinates, looked at in a screenshot (the charts' pixels, not only the DOM).

Set ``HM_TRIALS_SCREENSHOT=PATH`` to keep the page's screenshot (docs/images/ holds one).
"""

from __future__ import annotations

import gzip
import json
import os
import struct
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from hypermesh.agent.ops.trials import downsample
from tests.conftest import Mesh
from tests.ops.test_dashboard import browser, shown  # noqa: F401  (browser: a fixture)

# loss = base / (step + 1): base by lr, sgd half a point worse. Trials start in index
# order, two at a time: sgd's four and adam lr=0.1 complete (the pruner's five startup
# trials, median base 2.5: fewer than five are complete while any of them runs), adam
# lr=0.03 fails after two steps, adam lr=0.01 and 0.003 (bases 3 and 4) sit above the
# median, report slowly and are pruned once the five completed.
TRIAL = """\
import sys, time
opt, lr = sys.argv[1], float(sys.argv[2])
base = {0.1: 1.0, 0.03: 2.0, 0.01: 3.0, 0.003: 4.0}[lr] + (0.5 if opt == "sgd" else 0.0)
for step in range(6):
    print("HM_METRIC", '{"step": %d, "loss": %r, "acc": %r}'
          % (step, base / (step + 1), 1 - base / 10 / (step + 1)), flush=True)
    if opt == "adam" and lr == 0.03 and step == 1:
        sys.exit(3)
    time.sleep(0.4 if opt == "adam" and lr <= 0.01 else 0.05)
"""

RECIPE = """
name: trials
experiments:
  train:
    parameters:
      opt: {values: [sgd, adam]}
      lr: {values: [0.1, 0.03, 0.01, 0.003]}
    workers: 2
    objective: {metric: loss, goal: minimize}
    pruning: median
    command: ["python3 trial.py {{opt}} {{lr}}"]
"""


@pytest.mark.parametrize(
    ("n", "points", "kept"),
    [
        (0, 4, []),
        (3, 4, [0, 1, 2]),  # short enough: as it is
        (10, 4, [0, 3, 6, 9]),  # evenly spaced, the first and the last kept
        (101, 3, [0, 50, 100]),
    ],
)
def test_downsample_keeps_the_ends(n: int, points: int, kept: list[int]) -> None:
    curve = [[float(i), float(i * i)] for i in range(n)]
    assert downsample(curve, points) == [curve[i] for i in kept]


def _get(address: str, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and rows of RGB(A) bytes of an 8-bit PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), (depth, color)
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def colored_share(png: bytes) -> float:
    """The share of pixels that are neither white nor grey: drawn lines and the colour scale."""
    width, height, rows = png_pixels(png)
    bpp = len(rows[0]) // width
    colored = 0
    for row in rows:
        for x in range(0, len(row), bpp):
            r, g, b = row[x], row[x + 1], row[x + 2]
            colored += max(r, g, b) - min(r, g, b) > 40
    return colored / (width * height)


def test_trials_view_after_a_search(mesh: Mesh, browser: WebDriver,  # noqa: F811
                                    tmp_path: Path) -> None:
    node = mesh.agent("node1", slots=2)
    (mesh.root / "trial.py").write_text(TRIAL)
    wid = mesh.submit(mesh.write_recipe(RECIPE))
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "failed"

    # ---- the endpoint: the same rows as `best --json --incomplete`, plus index and metrics
    status, body = _get(node.http_address, f"/api/workflows/{wid}/trials")
    assert status == 200
    assert body["experiment"] == "train" and body["declared"] is True
    assert body["experiments"] == [{"name": "train", "objective": {"metric": "loss",
                                    "goal": "minimize"}, "metrics": ["acc", "loss"]}]
    assert body["objective"] == {"metric": "loss", "goal": "minimize"}
    assert body["params"] == ["opt", "lr"] and body["metrics"] == ["acc", "loss"]
    assert body["total"] == 8
    assert body["states"] == {"complete": 5, "pruned": 2, "failed": 1, "running": 0}
    rows = body["trials"]
    best = mesh.hm_json("best", wid, "-n", "8", "--incomplete")
    assert [{k: v for k, v in r.items() if k not in ("index", "metrics")} for r in rows] == best
    assert [(r["rank"], r["params"]["opt"], r["params"]["lr"]) for r in rows[:5]] == [
        (1, "adam", 0.1), (2, "sgd", 0.1), (3, "sgd", 0.03), (4, "sgd", 0.01), (5, "sgd", 0.003)]
    assert rows[0]["curve"] == [[s, 1.0 / (s + 1)] for s in range(6)]
    assert rows[0]["metrics"] == {"loss": 1.0 / 6, "acc": 1 - 0.1 / 6}
    by_state = {r["index"]: r["state"] for r in rows[5:]}
    assert by_state == {5: "failed", 6: "pruned", 7: "pruned"}
    failed = rows[5]
    assert [p[0] for p in failed["curve"]] == [0, 1] and failed["rank"] is None
    assert all(len(r["curve"]) < 6 for r in rows[6:])  # stopped early
    # Ranked by another metric, the other way; a bad experiment, goal or workflow.
    _, by_acc = _get(node.http_address, f"/api/workflows/{wid}/trials?metric=acc&goal=maximize")
    assert by_acc["objective"] == {"metric": "acc", "goal": "maximize"}
    assert [r["index"] for r in by_acc["trials"][:2]] == [4, 0]
    assert _get(node.http_address, f"/api/workflows/{wid}/trials?experiment=nope")[0] == 404
    assert _get(node.http_address, f"/api/workflows/{wid}/trials?goal=sideways")[0] == 400
    assert _get(node.http_address, "/api/workflows/nope-1/trials")[0] == 404
    # The vendored chart library goes out gzipped, and the browser may keep it.
    request = urllib.request.Request(f"http://{node.http_address}/vendor/echarts.min.js",
                                     headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.headers["Content-Encoding"] == "gzip" and "max-age" in r.headers["Cache-Control"]
        packed = r.read()
    assert len(packed) < 500_000 and len(gzip.decompress(packed)) > 1_000_000

    # ---- the page
    browser.set_window_size(1400, 1100)
    browser.get(f"http://{node.http_address}/")
    wait = WebDriverWait(browser, 20, poll_frequency=0.2)
    wait.until(shown(f'[data-wid="{wid}"]'))
    browser.find_element(By.CSS_SELECTOR, f'[data-wid="{wid}"]').click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#trial-table tbody tr")) == 8)
    assert len(browser.find_elements(By.CSS_SELECTOR, 'tr.trial[data-state="pruned"]')) == 2
    assert len(browser.find_elements(By.CSS_SELECTOR, 'tr.trial[data-state="failed"]')) == 1
    curves = browser.find_element(By.ID, "trials-curves")
    parallel = browser.find_element(By.ID, "trials-parallel")
    wait.until(lambda d: curves.get_attribute("data-series") == "8")  # all 8 curves chosen
    assert parallel.get_attribute("data-lines") == "8"  # each trial reported a loss
    # The charts are drawn: coloured lines on each chart's canvas, not a blank box.
    for chart in (curves, parallel):
        assert chart.size["height"] > 300 and chart.size["width"] > 400
        share = colored_share(chart.screenshot_as_png)
        assert share > 0.01, f"{chart.get_attribute('id')}: {share:.4f} coloured"
    shot = Path(os.environ.get("HM_TRIALS_SCREENSHOT") or tmp_path / "trials.png")
    browser.execute_script("document.getElementById('trials').scrollIntoView()")
    browser.find_element(By.ID, "trials").screenshot(str(shot))
    assert shot.stat().st_size > 10_000

    def column(key: str) -> list[str]:
        try:
            return [td.text for td in browser.find_elements(
                By.CSS_SELECTOR, f'#trial-table tbody td[data-col="{key}"]')]
        except StaleElementReferenceException:
            return []

    assert column("rank") == ["1", "2", "3", "4", "5", "-", "-", "-"]  # as ranked
    browser.find_element(By.CSS_SELECTOR, 'th[data-sort="param:lr"]').click()
    wait.until(lambda d: column("param:lr")[:2] == ["0.003", "0.003"])
    browser.find_element(By.CSS_SELECTOR, 'th[data-sort="param:lr"]').click()
    wait.until(lambda d: column("param:lr")[:2] == ["0.1", "0.1"])
    browser.find_element(By.CSS_SELECTOR, 'th[data-sort="metric:acc"]').click()
    wait.until(lambda d: (acc := [float(v) for v in column("metric:acc")]) == sorted(acc)
               and len(acc) == 8)
    # A click on a row takes its curve off the chart, another puts it back.
    row = f'#trial-table tr[data-task="{wid}.train.7"]'
    browser.find_element(By.CSS_SELECTOR, row).click()
    wait.until(lambda d: curves.get_attribute("data-series") == "7")
    browser.find_element(By.CSS_SELECTOR, row).click()
    wait.until(lambda d: curves.get_attribute("data-series") == "8")
