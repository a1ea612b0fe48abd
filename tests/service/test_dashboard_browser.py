"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright
(never a browser Playwright downloads), against a real service on loopback
(emulated engines) with a replayed job in flight.

The job is twelve short trajectories in three GRPO groups of four and one whose
tool call lasts a modelled week: once the twelve are delivered the job stands
still — 12 of 13 finished, one running, no more tokens — so that what the page
shows can be checked against what the API says at the same moment. One browser
for the module; every wait is for the page's own marker (`#updated`'s
`data-updates`, bumped after each complete refresh) or an element, never a sleep.
The screenshot goes to out/dashboard.png (docs/dashboard.png is one of these).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import running_service

from treadle.service.state import ServiceConfig

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = "/usr/bin/chromium"  # Debian's (scripts/test installs it)
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which(CHROMIUM) is None,
                                 reason="needs Debian's chromium (scripts/test installs it)")]
TOKEN = "dashboard-admin"
# Chromium's own traffic (updates, sync, field trials) has no network to reach here.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
OUT = Path(__file__).resolve().parents[2] / "out"
WAIT_MS = 60_000  # a bound for a hang: each wait ends when its event comes
SHORT = [{"id": f"s{g}-{i}", "group": f"g{g}", "prompt_tokens": 64,
          "turns": [{"output_tokens": 40, "tool_latency_s": 1.0, "tool_output_tokens": 10},
                    {"output_tokens": 30, "tool_latency_s": 0, "tool_output_tokens": 0}]}
         for g in range(3) for i in range(4)]
TAIL = {"id": "tail", "group": "g-tail", "prompt_tokens": 8,
        "turns": [{"output_tokens": 4, "tool_latency_s": 7 * 86400.0, "tool_output_tokens": 1},
                  {"output_tokens": 4, "tool_latency_s": 0, "tool_output_tokens": 0}]}


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _delivered(client: httpx.Client, job: str, count: int) -> None:
    """Read the job's followed stream until `count` trajectories are delivered."""
    with client.stream("GET", f"/v1/jobs/{job}/trajectories", params={"follow": "true"},
                       timeout=120) as stream:
        lines = (line for line in stream.iter_lines() if line)
        for _ in range(count):
            next(lines)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = tmp_path_factory.mktemp("dashboard") / "d.db"
    config = ServiceConfig(db=str(db), token=TOKEN, emulate=2, time_scale=0.05,
                           policy="verl", monitor_interval_s=0.25)
    with running_service(config) as url, \
            httpx.Client(base_url=url, headers=_auth(TOKEN), timeout=60) as admin:
        run_a = admin.post("/v1/keys", json={"trainer_run": "run-a"}).json()["key"]
        with httpx.Client(base_url=url, headers=_auth(run_a), timeout=60) as trainer:
            made = trainer.post("/v1/jobs", json={"tasks": {"workload": "math",
                                                            "trajectories": 2,
                                                            "group_size": 2},
                                                  "job_id": "run-a-job"})
            assert made.status_code == 201, made.text
            _delivered(trainer, "run-a-job", 2)
        made = admin.post("/v1/jobs", json={"tasks": {"trace": [*SHORT, TAIL]},
                                            "job_id": "live"})
        assert made.status_code == 201, made.text
        _delivered(admin, "live", 12)  # the tail runs on, for a modelled week
        yield {"url": url, "admin": admin, "run_a": run_a}
        admin.post("/v1/jobs/live/cancel")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


def _open(browser: Any, url: str, key: str) -> Any:
    """A fresh tab (its own session storage) signed in with `key`, after its first
    complete refresh."""
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.goto(f"{url}/dashboard?every=250")
    page.fill("#key", key)
    _click(page, "#login button[type=submit]")
    _refreshed(page)
    return page


def _click(page: Any, selector: str) -> None:
    """Scrolled into view first, then clicked: Playwright's own scroll-then-click
    sent the press to where the element had been before the scroll with Debian's
    Chromium 156 (nothing was clicked), as it never did with it in view."""
    target = page.locator(selector)
    target.scroll_into_view_if_needed(timeout=WAIT_MS)
    target.click(timeout=WAIT_MS)


def _refreshed(page: Any, after: int = 0) -> int:
    """Wait for a complete refresh past `after` (the count only grows); the page's
    count of them. (A locator's wait: the page's policy forbids the eval that
    `wait_for_function` needs, and the test keeps that policy on.)"""
    playwright.expect(page.locator("#updated")).not_to_have_attribute(
        "data-updates", str(after), timeout=WAIT_MS)
    return int(page.get_attribute("#updated", "data-updates"))


def _field(scope: Any, selector: str, field: str) -> str:
    text: str = scope.locator(f"{selector} [data-field='{field}']").first.inner_text()
    return text.strip()


def _canvas_pixels(page: Any, chart: str, rgb: tuple[int, int, int]) -> int:
    """Pixels of a chart's canvas within a few levels of `rgb` (its series' stroke)."""
    count: int = page.evaluate("""([id, rgb]) => {
        const c = document.querySelector(`#${id} canvas`);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4)
          if (d[i + 3] > 200 && Math.abs(d[i] - rgb[0]) < 8 && Math.abs(d[i + 1] - rgb[1]) < 8
              && Math.abs(d[i + 2] - rgb[2]) < 8) n++;
        return n; }""", [chart, list(rgb)])
    return count


def test_the_dashboard_shows_what_the_api_says_while_a_job_runs(
        world: dict[str, Any], browser: Any) -> None:
    admin: httpx.Client = world["admin"]
    page = _open(browser, world["url"], TOKEN)
    # The selected job (the newest: "live") is drawn once its timeline frame and its
    # groups are in; then one more complete refresh, so that all comes from one.
    page.wait_for_selector("#groups tr[data-group]", timeout=WAIT_MS)
    page.frame_locator("#timeline").locator("#tl").wait_for(timeout=WAIT_MS)
    _refreshed(page, _refreshed(page))

    jobs = admin.get("/v1/jobs").json()
    assert [j["job_id"] for j in jobs] == ["live", "run-a-job"]
    assert page.locator("#jobs tr[data-job]").count() == len(jobs)
    for job in jobs:
        row = f"#jobs tr[data-job='{job['job_id']}']"
        assert _field(page, row, "status") == job["status"]
        assert _field(page, row, "delivered") == f"{job['delivered']} / {job['planned']}"
        assert _field(page, row, "running") == str(job["running"])
        assert _field(page, row, "count_completed") == str(job["counts"]["completed"])
    live = jobs[0]
    assert (live["status"], live["delivered"], live["running"]) == ("running", 12, 1)

    engines = admin.get("/v1/engines").json()
    assert page.locator("#engines tr[data-engine]").count() == len(engines) == 2
    for engine in engines:
        row = f"#engines tr[data-engine='{engine['engine_id']}']"
        assert _field(page, row, "health") == engine["health"] == "healthy"
        assert _field(page, row, "policy_version") == str(engine["policy_version"])
        assert _field(page, row, "calls") == f"{engine['calls_in_flight']} / " \
                                             f"{engine['max_batch']}"
        assert engine["load"] is not None  # read while the page watches
        assert _field(page, row, "kv_usage") == f"{100 * engine['load']['kv_usage']:.1f}%"

    status = admin.get("/v1/status").json()
    assert _field(page, "#service-figures", "tokens_generated") == \
        f"{status['tokens_generated']:,}"
    assert _field(page, "#service-figures", "finished") == "14"  # 12 and run-a's 2
    assert _field(page, "#service-figures", "running") == f"1 / {status['max_live']}"

    groups = admin.get("/v1/jobs/live/groups").json()
    assert page.locator("#groups tr[data-group]").count() == groups["total"] == 4
    for group in groups["groups"]:
        row = f"#groups tr[data-group='{group['group_id']}']"
        assert _field(page, row, "finished") == \
            f"{group['finished']} / {len(group['trajectory_ids'])}"
        assert page.locator(f"{row} button[data-trajectory]").count() == \
            len(group["trajectory_ids"])

    # The timeline: the service's page in its sandboxed frame, the running row in it.
    frame = page.frame_locator("#timeline")
    rows = json.loads(frame.locator("#tl-data").text_content())["rows"]
    assert len(rows) == 13 and [r[1] for r in rows].count("running") == 1
    assert frame.locator("p.sum").first.inner_text().startswith("13 trajectories")

    # A trajectory's record: its turns and the policy versions that sampled them.
    first = groups["groups"][0]["trajectory_ids"][0]
    _click(page, f"#groups button[data-trajectory='{first}']")
    page.wait_for_selector("#record-figures [data-field='seq']", timeout=WAIT_MS)
    record = admin.get("/v1/jobs/live/record", params={"trajectory_id": first}).json()
    assert page.inner_text("#record-id") == first
    assert _field(page, "#record-figures", "seq") == str(record["seq"])
    assert _field(page, "#record-figures", "output_tokens") == str(record["output_tokens"])
    assert _field(page, "#record-figures", "policy_versions") == \
        ", ".join(map(str, record["policy_versions"]))
    assert page.locator("#turns tr").count() == 1 + len(record["turns"])

    # The charts are drawn: the throughput line's own colour in its canvas.
    assert _canvas_pixels(page, "chart-throughput", (0x3D, 0x5A, 0x80)) > 30
    assert _canvas_pixels(page, "chart-tail", (0x3D, 0x5A, 0x80)) > 30
    OUT.mkdir(exist_ok=True)
    shot = OUT / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    _not_blank(shot)
    page.context.close()


def test_a_trainer_key_sees_its_runs_jobs_only_and_a_wrong_key_is_refused(
        world: dict[str, Any], browser: Any) -> None:
    page = _open(browser, world["url"], world["run_a"])  # after its first refresh
    jobs = page.locator("#jobs tr[data-job]")
    assert [jobs.nth(i).get_attribute("data-job") for i in range(jobs.count())] == [
        "run-a-job"]  # not the admin's "live"
    page.wait_for_selector("#groups tr[data-group]", timeout=WAIT_MS)
    assert page.is_visible("#service-note") and not page.is_visible("#chart-throughput")
    assert page.locator("#engines tr[data-engine]").count() == 2  # the pool is open to it
    assert page.inner_text("#job-id") == "run-a-job"
    _click(page, "#forget")
    page.fill("#key", "trk_not-a-key")
    _click(page, "#login button[type=submit]")
    page.wait_for_selector("#login-error:has-text('refused')", timeout=WAIT_MS)
    assert page.is_hidden("#main")
    page.context.close()


def _not_blank(png: Path) -> None:
    """Most of the screenshot is background, but not all: tables and charts on it."""
    from PIL import Image

    image = Image.open(png).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None
    background = max(colours)[0]
    assert image.width >= 1400 and image.height >= 900
    assert background < 0.97 * image.width * image.height, "the screenshot is nearly blank"
    assert len(colours) > 50
