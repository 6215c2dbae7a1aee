"""The web console in a real browser: headless Debian Chromium driven by Selenium (through
Debian's chromium-driver), against a real server, agent and runc containers.

One walk through the console, as a user and as an admin: sign in, create a pod from a
template with a GPU from the fleet's free capacity, see it reach Running, watch its logs
arrive live (Server-Sent Events), stop it, find it in usage; a forged CSRF token is
refused; another project's user gets a 404 page for the pod; the admin cordons the node.
A screenshot of every page is saved under the test's temporary directory
(``console-shots/``; docs/console.md shows them)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpucloud.client.sdk import GpucloudClient
from gpucloud.core.spec import TemplateCreateRequest
from tests.e2e.cluster import ADMIN_KEY, Cloud, wait_for
from tests.e2e.conftest import PushedImages

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import (  # noqa: E402
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
TICKER = "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done"

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian chromium and chromium-driver")


@contextmanager
def chromium(downloads: Path) -> Iterator[WebDriver]:
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,800", "--no-first-run", "--disable-extensions",
                 "--disable-background-networking", "--disable-sync",
                 f"--user-data-dir={downloads}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(20)
    # Times must come out in the viewer's zone, not the server's UTC.
    driver.execute_cdp_cmd("Emulation.setTimezoneOverride", {"timezoneId": "Asia/Tokyo"})
    try:
        yield driver
    finally:
        driver.quit()


#: Chromium's message when an element found a moment ago left the document (the page was
#: replaced in between): an "unknown error", not a stale element reference.
_REPLACED_NODE = "does not belong to the document"


class Console:
    """The browser on the console, with a screenshot per page."""

    def __init__(self, driver: WebDriver, url: str, shots: Path) -> None:
        self.driver, self.url, self.shots = driver, url, shots
        shots.mkdir(parents=True, exist_ok=True)

    def open(self, path: str) -> None:
        self.driver.get(self.url + path)

    def text(self, css: str) -> str:
        return str(self.driver.find_element(By.CSS_SELECTOR, css).text)

    def row(self, css: str) -> str:
        """The element's text; when it is missing, a failure that shows which page is open."""
        found = self.driver.find_elements(By.CSS_SELECTOR, css)
        if not found:
            main = self.driver.find_elements(By.TAG_NAME, "main")
            raise AssertionError(f"no {css} on {self.driver.current_url}: "
                                 f"{main[0].text if main else self.driver.page_source[:2000]}")
        return str(found[0].text)

    def wait_redrawn(self) -> None:
        """Wait out the redraw console.js makes 300 ms after the pod ended."""
        wait_for(lambda: self.driver.execute_script(
            "return document.readyState === 'complete' && !document.body.dataset.redraw"),
            10, "the pod page redrawn after its end")

    def shot(self, name: str) -> None:
        self.driver.save_screenshot(str(self.shots / f"{name}.png"))

    def wait_text(self, css: str, needle: str, timeout: float = 30) -> str:
        def check() -> str | None:
            try:  # the page may be replaced between finding the element and reading it
                found = self.driver.find_elements(By.CSS_SELECTOR, css)
                text = str(found[0].text) if found else ""
            except StaleElementReferenceException:
                return None
            except WebDriverException as error:  # chromium's form of the same race
                if _REPLACED_NODE not in str(error.msg):
                    raise
                return None
            return text if needle in text else None

        return wait_for(check, timeout, f"{needle!r} in {css}")

    def sign_in(self, key: str) -> None:
        self.open("/")  # redirected: /console → /console/pods → /console/login
        assert self.driver.current_url.endswith("/console/login")
        field = self.driver.find_element(By.ID, "api_key")
        field.send_keys(key)
        field.submit()
        self.wait_text("h1", "Pods")

    def sign_out(self) -> None:
        self.driver.find_element(By.ID, "logout").click()
        self.wait_text("h1", "Sign in")

    def click(self, css: str) -> None:
        self.driver.find_element(By.CSS_SELECTOR, css).click()


def _create_from_template(console: Console) -> None:
    driver = console.driver
    driver.find_element(By.ID, "name").send_keys("web")
    Select(driver.find_element(By.ID, "template")).select_by_value("ticker")
    gpu_type = Select(driver.find_element(By.ID, "gpu_type"))
    assert [o.text for o in gpu_type.options][1:] == ["H100-80GB (8 free on one node)"]
    gpu_type.select_by_index(1)
    Select(driver.find_element(By.ID, "gpus")).select_by_value("1")
    console.shot("pods-create")
    console.click("#create")
    console.wait_text("h1", "Pod web")


def test_console_walkthrough_in_chromium(cloud: Cloud, images: PushedImages,
                                         tmp_path: Path) -> None:
    cloud.agent("gpu-a")
    team = cloud.client.create_project("team-a").key.key
    stranger = cloud.client.create_project("team-b").key.key
    client = GpucloudClient(cloud.url, team)
    try:
        client.create_template(TemplateCreateRequest(
            name="ticker", image=images.busybox, command=["sh", "-c", TICKER], ports=["8080/http"]))
        with chromium(tmp_path / "profile") as driver:
            console = Console(driver, cloud.url, tmp_path / "console-shots")
            console.sign_in(team)
            _create_from_template(console)
            console.wait_text("#phase", "Running")
            wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#started time"), 10,
                     "Started filled from the stream")
            console.wait_text("#logs", "tick 3")  # arrived over the stream, no reload
            assert "port 8080" in console.text("#ports")
            created = driver.find_element(By.CSS_SELECTOR, ".facts time")
            assert created.text != created.get_attribute("datetime")  # formatted locally
            console.shot("pod-running")
            console.click("form[action$='/stop'] button")
            console.wait_text("#phase", "Stopped")
            console.wait_redrawn()
            pod = client.get_pod("web")
            assert pod.phase == "Stopped"

            console.open("/console/usage")
            row = console.row("#usage-pods tr[data-pod='web']")
            assert row.startswith("web 1 ")  # one run, metered from Running to Stopped
            assert "GPU-hours per day" in console.text("main")
            console.shot("usage")
            console.open("/console/nodes")
            console.shot("nodes")
            _dark(driver, "dark")
            console.open(f"/console/pods/{pod.id}")
            console.wait_text("#logs", "tick 3")  # a stopped pod's log, streamed once
            console.shot("pod-dark")
            _dark(driver, "light")
            console.open("/console/keys")
            console.shot("keys")

            # A form whose CSRF token was tampered with is refused, and nothing happens.
            console.open("/console/pods")
            driver.execute_script(
                "document.querySelector('#create-pod [name=csrf_token]').value = 'forged'")
            driver.find_element(By.ID, "name").send_keys("forged")
            console.click("#create")
            assert "CSRF" in console.wait_text("#error-detail", "CSRF")
            assert [p.name for p in client.list_pods()] == ["web"]

            console.open("/console/pods")
            console.sign_out()
            console.sign_in(stranger)
            console.open(f"/console/pods/{pod.id}")
            assert "not found" in console.wait_text("#error-detail", "not found")
            console.shot("other-project-404")
            console.sign_out()

            console.sign_in(ADMIN_KEY)
            console.open("/console/nodes")
            console.click("form[action$='/gpu-a/cordon'] button")
            console.wait_text("[data-node='gpu-a'] h2", "cordoned")
            assert cloud.client.get_node("gpu-a").cordoned
            console.shot("nodes-admin-cordoned")
            _dark(driver, "dark")
            console.open("/console/nodes")
            console.shot("nodes-dark")
            driver.set_window_size(390, 844)
            console.open("/console/pods")
            console.shot("pods-phone")
    finally:
        client.close()
    shots = sorted(p.name for p in (tmp_path / "console-shots").iterdir())
    assert len(shots) == 10 and all((tmp_path / "console-shots" / s).stat().st_size > 5000
                                    for s in shots)
    _keep_for_docs(tmp_path / "console-shots")


def _dark(driver: WebDriver, scheme: str) -> None:
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {
        "features": [{"name": "prefers-color-scheme", "value": scheme}]})


def _keep_for_docs(shots: Path) -> None:
    """``GPUCLOUD_CONSOLE_SHOTS=DIR``: copy the screenshots there (docs/console/)."""
    target = os.environ.get("GPUCLOUD_CONSOLE_SHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        for shot in shots.iterdir():
            shutil.copy(shot, Path(target) / shot.name)
