"""Debian's headless Chromium, driven by Selenium, for the tests that look at a page (the Django
admin, the audit's report). Their screenshots are kept under ``test-artifacts/``."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from .services import services_required

ARTIFACTS = Path(__file__).parents[1] / "test-artifacts"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@contextmanager
def chromium(window: str = "1400,1000") -> Iterator:
    """A headless Chromium of the given window size; skipped (failed where services are required)
    when Debian's chromium and chromium-driver are not installed."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        message = f"the browser tests need Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER})"
        if services_required():
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={window}"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver, folder: str, name: str) -> Path:
    """Keep a screenshot of the page as ``test-artifacts/<folder>/<name>.png``."""
    path = ARTIFACTS / folder / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(path)), f"no screenshot of {name}"
    assert path.stat().st_size > 0
    return path
