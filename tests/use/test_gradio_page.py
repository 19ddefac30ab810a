"""`shardforge inference --gradio`: the chat page served on 127.0.0.1, opened in a real headless
Chromium (Selenium and chromedriver, Debian's packages): a prompt typed, the streamed answer read
from the page, a second turn, the settings on the page; nothing but the page's own server asked
for; the server and the browser gone afterwards. Without Gradio: one error line naming the
extra."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers.procs import still_running
from helpers.tiny import PARROT_ANSWER

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# Chromium as root, headless, asking nothing of the network on its own
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1100,1000",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Any, seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def page(parrot: Path, parrot_cfg: Path, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """The page's URL and its server's pid: `inference --gradio` on the parrot model."""
    port = free_port()
    err = (tmp_path / "stderr").open("w+")
    args = [sys.executable, "-m", "shardforge.cli.main", "inference", str(parrot_cfg)]
    args += ["--model_dir", str(parrot), "--gradio", "--gradio_server_port", str(port)]
    args += ["--gradio_temperature", "0", "--gradio_max_new_tokens", "32"]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: (
                f"page: {url}" in (tmp_path / "stderr").read_text() or server.poll() is not None
            ),
            240,
            "the page",
        )
        assert server.poll() is None, (tmp_path / "stderr").read_text()
        yield url, server.pid
        server.send_signal(signal.SIGTERM)  # closed as Ctrl-C closes it: exit 0
        assert server.wait(60) == 0, (tmp_path / "stderr").read_text()
        assert "page closed" in (tmp_path / "stderr").read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        err.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (cicd/setup.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="shardforge-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    started = [driver.service.process.pid]
    started += [p.pid for p in psutil.Process(started[0]).children(recursive=True)]
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
        assert still_running(started, 10) == [], "chromium outlived the test"


def prompt_box(driver: Any) -> Any:
    """The page's prompt box, where it takes text (None while a reply is generated)."""
    from selenium.webdriver.common.by import By

    boxes = driver.find_elements(By.CSS_SELECTOR, "#prompt textarea")
    return next((b for b in boxes if b.is_displayed() and b.is_enabled()), None)


def answers(driver: Any) -> list[str]:
    """The assistant's messages on the page, read in one go (the page re-renders as it
    streams)."""
    script = "return [...document.querySelectorAll('#chat .bot.message')].map(e => e.innerText)"
    return [str(text).strip() for text in driver.execute_script(script)]


def requested(driver: Any) -> set[str]:
    """Every http(s) URL the page asked for (Chromium's network log)."""
    urls = set()
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            url = message["params"]["request"]["url"]
            if url.startswith(("http:", "https:", "ws:", "wss:")):
                urls.add(url)
    return urls


@pytest.mark.slow  # the page's server and the browser are processes
def test_the_page_streams_the_answer_in_a_real_browser(
    page: tuple[str, int], browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    url, pid = page
    connections = psutil.Process(pid).net_connections()
    listening = [c.laddr for c in connections if c.status == "LISTEN"]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
    browser.get(url)
    wait_for(lambda: prompt_box(browser), 60, "the prompt box")
    # the settings on the page: the config's gradio_* keys as starting values
    sliders = {
        str(e.get_attribute("aria-label")).removeprefix("number input for "): e.get_attribute(
            "value"
        )
        for e in browser.find_elements(By.CSS_SELECTOR, "input[type=number]")
    }
    assert {"temperature", "max_new_tokens", "top_p", "top_k", "repetition_penalty"} <= set(
        sliders
    ), sliders
    assert float(sliders["temperature"]) == 0 and int(sliders["max_new_tokens"]) == 32
    prompt_box(browser).send_keys("What do you see?", Keys.ENTER)
    wait_for(lambda: answers(browser) == [PARROT_ANSWER], 120, "the first answer")
    # a second turn on the same page, once the box takes text again
    wait_for(lambda: prompt_box(browser), 60, "the prompt box").send_keys("And now?", Keys.ENTER)
    wait_for(lambda: answers(browser) == [PARROT_ANSWER] * 2, 120, "the second answer")
    # the server asked nothing outside this machine either (no analytics, no version check)
    peers = [c.raddr for c in psutil.Process(pid).net_connections() if c.raddr]
    assert all(p.ip == "127.0.0.1" for p in peers), peers
    asked = requested(browser)
    assert asked and all(u.startswith((url, url.replace("http", "ws", 1))) for u in asked), asked
    browser.save_screenshot(str(tmp_path / "page.png"))


def test_without_gradio_one_error_line_names_the_extra(
    parrot: Path, parrot_cfg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from shardforge.cli.main import cli

    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio: ImportError
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "True")  # restored after the test
    args = ["inference", str(parrot_cfg), "--model_dir", str(parrot), "--gradio"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip() == (
        "error: inference --gradio needs Gradio, which is not installed: pip install "
        "'shardforge[ui]' (or use --chat, the chat in the terminal)"
    )
    assert "model:" not in result.stderr  # refused before the model is loaded
    assert os.environ["GRADIO_ANALYTICS_ENABLED"] == "False"
