"""The race page end to end in a real headless browser (Debian's chromium driven by Playwright's Python
client; no browser download): `specdec race` on a tiny model, the simulated race advancing and
answering its knobs, the widgets, a short live race, an error shown in the page, and a screenshot
saved as a test artifact (out/test-artifacts/race.png).

Fails when chromium is missing (`make test` installs it); SPECDEC_SKIP_BROWSER=1 skips it."""

import os
import queue
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from specdec import theory

ARTIFACTS = Path(__file__).resolve().parents[1] / "out" / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

if os.environ.get("SPECDEC_SKIP_BROWSER") == "1":
    pytest.skip("SPECDEC_SKIP_BROWSER=1", allow_module_level=True)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("chromium is missing: `apt-get install chromium` (make test does), or set SPECDEC_SKIP_BROWSER=1")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.tiny import save_tiny

    folder = save_tiny("llama", tmp_path_factory.mktemp("browser"))
    env = dict(os.environ, SPECDEC_HOME=str(tmp_path_factory.mktemp("home")))
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "race", "--model", str(folder), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        url, seen = None, []
        while url is None:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                pytest.fail(f"`specdec race` printed no URL within 60 s: {''.join(seen)}")
            seen.append(line)
            if "http://" in line:
                url = line[line.index("http://"):].split()[0]
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def number(page, selector) -> float:
    return float(page.inner_text(selector).replace("×", "").strip())


@contextmanager
def race_page(server, tmp_path, width: int):
    """The race page, loaded and ready, in headless chromium: (page, errors), the page's script errors."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install -e '.[test]'")
    errors: list[str] = []
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=chromium(), headless=True,
                                                    args=CHROMIUM_ARGS, viewport={"width": width, "height": 900})
        try:
            page = ctx.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server)
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            yield page, errors
        finally:
            ctx.close()


def test_race_page(server, tmp_path):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with race_page(server, tmp_path, 1440) as (page, errors):
        assert page.inner_text("#r-predicted") == f"{theory.speedup(0.82, 4, 0.002):.2f}×"  # 3.47x

        # the simulated race: both lanes advance and the readouts follow
        page.select_option("#speed", "0.2")
        page.click("#play")
        page.wait_for_function("Number(document.getElementById('v-tokens').textContent) > 5 && "
                               "Number(document.getElementById('s-tokens').textContent) > 10", timeout=20_000)
        assert page.inner_text("#r-measured") != "–" and page.inner_text("#r-mean") != "–"

        # change k, then the workload: the formula's prediction and the lanes answer
        page.eval_on_selector("#k", "el => { el.value = 8; el.dispatchEvent(new Event('input')); }")
        want = f"{theory.speedup(0.82, 8, 0.002):.2f}×"
        page.wait_for_function(f"document.getElementById('r-predicted').textContent === '{want}'", timeout=10_000)
        page.select_option("#preset", "creative-writing")
        want = f"{theory.speedup(0.15, 8, 0.1):.2f}×"  # Ch. 2's 0.65x
        page.wait_for_function(f"document.getElementById('r-predicted').textContent === '{want}'", timeout=10_000)
        assert page.inner_text("output[for=alpha]") == "0.15" and page.inner_text("output[for=k]") == "8"
        v0, s0 = number(page, "#v-tokens"), number(page, "#s-tokens")
        page.wait_for_function(f"Number(document.getElementById('v-tokens').textContent) > {v0 + 5} && "
                               f"Number(document.getElementById('s-tokens').textContent) > {s0 + 5}", timeout=20_000)
        page.wait_for_function("document.getElementById('r-mean').textContent !== '–'", timeout=10_000)
        assert number(page, "#r-mean") < 3  # alpha 0.15: rounds of about one token

        # widgets drawn from the theory endpoints
        assert page.locator("#surface rect").count() == 21 * 11
        assert page.locator("#rounds rect").count() == 9  # k = 8 follows the race: 1..9 tokens
        assert page.locator("#alloc .chip.on").count() == 7  # Ch. 7: 7 of 10 chats at B = 120
        page.fill("#w-tau", "-1")  # the surface's error stays when a knob changes (it redrew the last good surface)
        page.wait_for_function("document.querySelectorAll('#surface rect').length === 0", timeout=10_000)
        page.eval_on_selector("#k", "el => { el.value = 6; el.dispatchEvent(new Event('input')); }")
        page.wait_for_function("document.getElementById('r-predicted').textContent === "
                               f"'{theory.speedup(0.15, 6, 0.1):.2f}×'", timeout=10_000)
        assert page.locator("#surface rect").count() == 0 and "tau" in page.text_content("#surface")
        page.fill("#w-tau", "0.1")
        page.wait_for_function("document.querySelectorAll('#surface rect').length === 231", timeout=10_000)
        page.eval_on_selector("#k", "el => { el.value = 8; el.dispatchEvent(new Event('input')); }")

        # a bad request's message is shown in the page
        page.fill("#live-k", "fast")
        page.click("#go")
        page.wait_for_selector("#live-error:not([hidden])", timeout=10_000)
        assert "k:" in page.inner_text("#live-error")

        # a short live race on the tiny model, replayed side by side
        page.fill("#live-k", "auto")
        page.fill("#prompt", "abcabcabcabcabc")
        page.select_option("#method", "prompt-lookup")
        page.fill("#max-new", "16")
        page.click("#go")
        page.wait_for_function("document.querySelectorAll('#lm-stats div').length > 0 && "
                               "document.querySelectorAll('#lp-text .tok').length > 0 && "
                               "document.querySelectorAll('#lm-text .tok').length > 0", timeout=90_000)
        assert page.locator("#live-error").is_hidden()
        assert "tokens/s" in page.inner_text("#lm-stats") and "×" in page.inner_text("#live-summary")
        page.wait_for_function("document.getElementById('lm-clock').textContent.startsWith('finished')", timeout=30_000)
        page.screenshot(path=str(ARTIFACTS / "race.png"), full_page=True)

        # a race that fails while it runs (a prompt past the tiny model's 256-token context): its error alone,
        # not the last race's lanes and summary beside it, nor a progress bar stuck on "running plain"
        page.fill("#prompt", "ab " * 300)
        page.click("#go")
        page.wait_for_selector("#live-error:not([hidden])", timeout=30_000)
        assert "context" in page.inner_text("#live-error")
        assert page.locator("#live-progress").is_hidden() and page.inner_text("#live-summary") == ""
        assert page.locator("#lm-stats div").count() == 0 and page.locator("#lp-text .tok").count() == 0
    assert not errors, errors
    assert (ARTIFACTS / "race.png").stat().st_size > 10_000


def test_an_invalid_knob_pauses_the_race_until_it_is_fixed(server, tmp_path):
    """QA session: budget 0 (or blank) showed its error and paused the race; putting 156 back hid the
    error but left the race frozen until Play was pressed again. Now it resumes by itself, unless the
    user paused it meanwhile."""
    with race_page(server, tmp_path, 1280) as (page, errors):
        page.select_option("#speed", "1")
        page.click("#play")
        page.wait_for_function("Number(document.getElementById('v-tokens').textContent) > 5", timeout=20_000)
        set_budget = "v => { const e = document.getElementById('budget'); e.value = v; e.dispatchEvent(new Event('input')); }"
        page.evaluate(set_budget, "0")
        page.wait_for_selector("#sim-error:not([hidden])", timeout=10_000)
        assert "budget" in page.inner_text("#sim-error")
        page.evaluate(set_budget, "156")
        page.wait_for_selector("#sim-error", state="hidden", timeout=10_000)
        v0 = number(page, "#v-tokens")
        page.wait_for_function(f"Number(document.getElementById('v-tokens').textContent) > {v0 + 5}", timeout=10_000)

        # paused by the user: fixing a knob does not start it again
        page.click("#pause")
        page.evaluate(set_budget, "0")
        page.wait_for_selector("#sim-error:not([hidden])", timeout=10_000)
        page.evaluate(set_budget, "156")
        page.wait_for_selector("#sim-error", state="hidden", timeout=10_000)
        v1 = number(page, "#v-tokens")
        page.wait_for_timeout(600)
        assert number(page, "#v-tokens") == v1

        # k = 0 in the bursts widget: no bonus to speak of
        page.eval_on_selector("#w-k", "el => { el.value = 0; el.dispatchEvent(new Event('input')); }")
        page.wait_for_function("document.getElementById('rounds-note').textContent.includes('plain step')", timeout=10_000)
    assert not errors, errors
