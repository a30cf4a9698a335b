"""The page at GET /: `vericache serve` (real model, embedded) as an OS process, the page in a
real headless Chromium (Debian's chromium and chromedriver, driven by Selenium; `make setup`
installs them). A prompt streams an answer whose tokens are coloured by how they came; the
figures the page shows equal what /metrics reports; switching the mode changes τ. Also: every
metric the Grafana dashboard (deploy/grafana/) queries is exposed by /metrics.

Chromium or its driver missing fails this module; it never skips."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from service_process import REPO, start_serve

pytestmark = pytest.mark.slow  # a model-loading server and a browser: about a minute

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
KINDS = {"prefill", "draft", "bonus", "plain", "lossy"}
SCREENSHOT = REPO / "docs" / "img" / "page.png"  # refreshed with VERICACHE_SCREENSHOT=1
PROMPT = "Write a Python function that reverses a string."


@pytest.fixture(scope="module")
def base():
    service = start_serve(["--max-tokens", "32"], env={"OMP_NUM_THREADS": "1"})
    yield f"http://{service.address}"
    assert service.stop() == 0, service.log()
    service.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def browser():
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists() and not shutil.which(Path(path).name):
            pytest.fail(f"{path} is missing: `make setup` installs Debian's chromium and "
                        f"chromium-driver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def scrape(base: str) -> dict[str, float]:
    """/metrics samples without labels (and the labelled ones under their full name)."""
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def text(driver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def ask(driver, mode: str, k: int, max_tokens: int = 24) -> None:
    """Set the controls (adaptive k off: k drafts every round), send the prompt, wait."""
    driver.execute_script(
        "const [mode, k, n] = arguments;"
        "document.getElementById('mode').value = mode;"
        "document.getElementById('mode').dispatchEvent(new Event('change'));"
        "document.getElementById('draft_len').value = k;"
        "document.getElementById('max_tokens').value = n;"
        "document.getElementById('adaptive').checked = false;"
        "document.getElementById('compressor').value = 'snapkv';", mode, k, max_tokens)
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(PROMPT)
    driver.find_element(By.ID, "send").click()
    WebDriverWait(driver, 240).until(
        lambda d: d.find_element(By.ID, "status").get_attribute("data-state") in ("done", "error"))
    assert driver.find_element(By.ID, "status").get_attribute("data-state") == "done", \
        text(driver, "#status")


def test_page_streams_coloured_tokens_and_shows_what_metrics_report(base, browser, tmp_path):
    browser.get(base + "/")
    WebDriverWait(browser, 30).until(lambda d: text(d, "#ready") == "ready")
    assert text(browser, "#model") == "smollm2-135m-instruct"

    # full decoding first: one plain step per token (τ = 1), no drafts
    ask(browser, "full", 4)
    kinds = {c for s in browser.find_elements(By.CSS_SELECTOR, "#answer span.tok")
             for c in s.get_attribute("class").split()}
    assert "tok-draft" not in kinds and "tok-plain" in kinds
    row = browser.find_element(By.CSS_SELECTOR, "#requests tbody tr")
    assert row.find_element(By.CLASS_NAME, "req-mode").text == "full"
    assert float(row.find_element(By.CLASS_NAME, "req-tau").text) == 1.0

    # the controls switch to vericache, snapkv, k = 4: accepted drafts, τ above 1
    ask(browser, "vericache", 4)
    spans = browser.find_elements(By.CSS_SELECTOR, "#answer span.tok")
    assert spans, "no token spans"
    kinds = [next(c[4:] for c in s.get_attribute("class").split() if c.startswith("tok-"))
             for s in spans]
    assert set(kinds) <= KINDS, kinds
    assert "draft" in kinds, kinds  # snapkv drafts at k = 4 on a short prompt are accepted
    assert kinds[0] == "prefill"
    rows = browser.find_elements(By.CSS_SELECTOR, "#requests tbody tr")
    assert len(rows) == 2 and rows[0].find_element(By.CLASS_NAME, "req-mode").text == "vericache"
    vc_tau = float(rows[0].find_element(By.CLASS_NAME, "req-tau").text)
    vc_tokens = int(rows[0].find_element(By.CLASS_NAME, "req-tokens").text)
    assert vc_tokens == len(spans) and vc_tau > 1.0

    # the live figures equal /metrics (nothing else runs): the page scrapes every second
    def same_as_metrics(_):
        m = scrape(base)
        tau = m["vericache_tokens_per_round_sum"] / m["vericache_tokens_per_round_count"]
        return (text(browser, "#m-tokens") == str(int(m["vericache_tokens_total"]))
                and text(browser, "#m-tau") == f"{tau:.3f}")
    WebDriverWait(browser, 15).until(same_as_metrics)
    assert int(text(browser, "#m-tokens")) >= vc_tokens
    time.sleep(2)  # a few more scrapes drawn on the charts

    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
    print(f"screenshot: {shot}")
    if os.environ.get("VERICACHE_SCREENSHOT") == "1" and shot.stat().st_size < 300_000:
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)


def test_stream_chunks_carry_token_provenance(base):
    """The extension on streamed chunks: each token's id, kind and text; OpenAI fields intact."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "stream": True,
            "temperature": 0, "vericache": {"draft_len": 4, "adaptive": False}}
    tokens, content = [], ""
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    content += chunk["choices"][0]["delta"].get("content") or ""
                tokens += chunk.get("vericache", {}).get("tokens", [])
    assert len(tokens) == 12 and {t["kind"] for t in tokens} <= KINDS
    assert "".join(t["text"] for t in tokens) == content


def test_dashboard_queries_only_exposed_metrics(base):
    dash = json.loads((REPO / "deploy" / "grafana" / "vericache.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queried = {n for e in exprs for n in re.findall(r"\bvericache_[a-z_]+", e)}
    exposed = {re.sub(r"\{.*", "", name) for name in scrape(base)}
    assert queried and queried <= exposed, sorted(queried - exposed)
    for name in ("vericache_time_to_first_token_seconds_count",
                 "vericache_time_per_output_token_seconds_count", "vericache_queue_seconds_count"):
        assert scrape(base)[name] >= 1, name  # observed by the requests above
