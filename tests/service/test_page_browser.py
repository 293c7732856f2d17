"""The web page in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright
against the shared test server. Describes the tiny clip, checks the filmstrip against the
result, triggers a 413 and checks its message is shown, shows the demo model's answers when a
task sample is picked; screenshots go to bench/out/.

Skips when Chromium or Playwright is missing, unless STILLCUT_REQUIRE_BROWSER=1 (CI).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from stillcut.service.config import ServerConfig
from stillcut.service.page_routes import STATIC_DIR

from .conftest import MAX_UPLOAD_BYTES, running_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # a synthetic camera, granted without a prompt, for the webcam source of live mode
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
]
SCREENSHOT_DIR = Path(__file__).resolve().parents[2] / "bench" / "out"
VIEWPORTS = {"page.png": (1280, 800), "page_phone.png": (390, 844)}
TIMEOUT_MS = 120_000


def _missing_browser() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is absent (install Debian's 'chromium' package)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the 'playwright' Python package is not installed (pip install -e '.[dev]')"
    return None


@pytest.fixture(scope="module")
def browser():
    reason = _missing_browser()
    if reason is not None:
        if os.environ.get("STILLCUT_REQUIRE_BROWSER") == "1":
            pytest.fail(f"STILLCUT_REQUIRE_BROWSER=1 but {reason}")
        print(f"skipping the browser test: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _open_page(browser, url: str, size: tuple[int, int]):
    page = browser.new_page(viewport={"width": size[0], "height": size[1]})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def _result_of(sse_body: str) -> dict:
    events = [line.removeprefix("data: ") for line in sse_body.splitlines() if line]
    results = [json.loads(e) for e in events if e != "[DONE]" and '"type":"result"' in e]
    assert len(results) == 1, sse_body[:500]
    return results[0]


@pytest.mark.parametrize("screenshot", VIEWPORTS)
def test_describe_shows_what_evs_kept(browser, main_server, tmp_path, screenshot):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(main_server.clip)
    page, errors = _open_page(browser, main_server.url + "/", VIEWPORTS[screenshot])
    page.set_input_files("#file", str(clip))
    with page.expect_response("**/v1/videos/describe", timeout=TIMEOUT_MS) as response:
        page.click("#ask")
    page.wait_for_selector("body[data-state=done]", timeout=TIMEOUT_MS)
    result = _result_of(response.value.text())

    assert page.locator("#error").is_hidden()
    assert page.locator("#answer").inner_text() == result["text"]
    frames = page.locator("#filmstrip .frame")
    assert frames.count() == result["evs"]["frames"] == len(result["frame_timestamps"]) == 6
    _, h, w = result["frames"]["grid"]
    kept = result["evs"]["kept_per_tubelet"]
    assert sum(kept) < len(kept) * h * w  # the default rate EVS pruned something
    for k in range(frames.count()):
        tubelet = int(frames.nth(k).get_attribute("data-tubelet"))
        assert tubelet == k // 2
        pruned = frames.nth(k).locator(".cell.pruned").count()
        assert pruned == h * w - kept[tubelet], (k, pruned, kept)
        assert frames.nth(k).locator(".cell.kept").count() == kept[tubelet]
    numbers = page.locator("#numbers").inner_text()
    assert str(result["evs"]["tokens_before"]) in numbers
    assert str(result["evs"]["tokens_after"]) in numbers
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT_DIR / screenshot), full_page=True)
    assert errors == []
    page.close()


def test_oversized_upload_shows_the_server_message(browser, main_server, tmp_path):
    big = tmp_path / "big.mp4"
    big.write_bytes(b"\0" * (MAX_UPLOAD_BYTES * 2 + 1))
    page, errors = _open_page(browser, main_server.url + "/", (1280, 800))
    page.set_input_files("#file", str(big))
    page.click("#ask")
    page.wait_for_selector("body[data-state=done]", timeout=TIMEOUT_MS)
    message = page.locator("#error").inner_text()
    assert "exceeds the limit" in message
    assert page.locator("#filmstrip .frame").count() == 0
    # the browser itself logs the failed request (413); nothing else may go wrong
    assert [e for e in errors if "413" not in e] == []
    page.close()


def test_picking_a_task_sample_shows_the_demo_answers(browser, main_server):
    stored = json.loads((STATIC_DIR / "sample_answers.json").read_text())
    name, rows = next(iter(stored["samples"].items()))
    page, errors = _open_page(browser, main_server.url + "/", (1280, 800))
    page.wait_for_function("document.querySelector('#sample').options.length > 1")
    assert page.locator("#sample-answers").is_hidden()
    page.select_option("#sample", value=name)
    page.wait_for_selector("#sample-answers:not([hidden])", timeout=TIMEOUT_MS)
    shown = page.locator("#sample-answers-table tr.sample-answer")
    assert shown.count() == len(rows)
    for k, row in enumerate(rows):
        text = shown.nth(k).inner_text()
        assert row["question"] in text and row["answer"] in text and row["truth"] in text
    page.select_option("#sample", value="pan.mp4")  # not a task sample: nothing to show
    assert page.locator("#sample-answers").is_hidden()
    assert errors == []
    page.close()


@pytest.mark.parametrize(
    "source", [{"value": "moving_object.mp4"}, {"label": "webcam"}], ids=["sample", "webcam"]
)
def test_live_mode_streams_and_answers(browser, main_server, source):
    """A sample (seeked frame by frame) or Chromium's fake camera (real time)."""
    page, errors = _open_page(browser, main_server.url + "/", (1280, 800))
    page.click("#tab-live")
    page.wait_for_function("document.querySelector('#live-sample').options.length > 1")
    page.select_option("#live-sample", **source)
    page.click("#live-start")
    page.wait_for_selector("#live-bars .bar >> nth=1", timeout=TIMEOUT_MS)
    page.fill("#live-prompt", "What moves?")
    page.click("#live-ask")
    page.wait_for_function(
        "document.querySelector('#live-answer').textContent.length > 0", timeout=TIMEOUT_MS
    )
    page.click("#live-stop")
    page.wait_for_selector("#live-start:not([disabled])", timeout=TIMEOUT_MS)
    assert page.locator("#error").is_hidden(), page.locator("#error").inner_text()
    assert errors == []
    page.close()


def test_live_mode_narrates_a_sample(browser, main_server):
    page, errors = _open_page(browser, main_server.url + "/", (1280, 800))
    page.click("#tab-live")
    page.wait_for_function("document.querySelector('#live-sample').options.length > 1")
    page.select_option("#live-sample", value="moving_object.mp4")
    page.check("#live-narrate")
    page.fill("#live-prompt", "Narrate what moves.")
    page.click("#live-start")
    # each segment ends with its tubelet's times
    page.wait_for_function(
        "document.querySelector('#live-answer').textContent.includes('1.0-1.5 s')",
        timeout=TIMEOUT_MS,
    )
    assert page.locator("#live-ask").is_disabled()
    page.click("#live-stop")
    page.wait_for_selector("#live-start:not([disabled])", timeout=TIMEOUT_MS)
    assert page.locator("#error").is_hidden(), page.locator("#error").inner_text()
    assert errors == []
    page.close()


def test_live_mode_sends_the_key_as_a_subprotocol(browser, tiny_checkpoint):
    """A browser cannot set headers on a WebSocket: on a server with a key, the page offers
    it as a subprotocol, and the session starts and answers."""
    key = "sk-page/+=key"  # characters a subprotocol token may not hold: base64url needs them
    with running_server(tiny_checkpoint, ServerConfig(api_key=key)) as server:
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        sent: list[str] = []
        page.on(
            "websocket",
            lambda socket: socket.on("framesent", lambda frame: sent.append(str(frame))),
        )
        page.add_init_script(f"sessionStorage.setItem('stillcut.apiKey', {json.dumps(key)})")
        page.goto(server.url + "/")
        page.click("#tab-live")
        page.wait_for_function("document.querySelector('#live-sample').options.length > 1")
        page.select_option("#live-sample", value="moving_object.mp4")
        page.click("#live-start")
        page.wait_for_selector("#live-bars .bar >> nth=1", timeout=TIMEOUT_MS)
        page.fill("#live-prompt", "What moves?")
        page.click("#live-ask")
        page.wait_for_function(
            "document.querySelector('#live-answer').textContent.length > 0", timeout=TIMEOUT_MS
        )
        page.click("#live-stop")
        page.wait_for_selector("#live-start:not([disabled])", timeout=TIMEOUT_MS)
        assert page.locator("#error").is_hidden(), page.locator("#error").inner_text()
        assert errors == []
        assert sent and not any(key in frame for frame in sent)  # not in the start message
        page.close()
        assert httpx.get(f"{server.url}/health").json()["live_sessions"] == 0
