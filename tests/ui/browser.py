"""Headless Chromium from Debian (``chromium`` + ``chromium-driver``, installed by
``make test``), driven through Selenium with explicit paths: nothing is downloaded
at test time, and each browser gets a fresh profile folder."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--window-size=1280,860",
)


def find_binaries() -> tuple[str, str] | None:
    """(chromium, chromedriver) paths, or None when either is missing."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None and Path("/usr/lib/chromium/chromium").is_file():
        browser = "/usr/lib/chromium/chromium"
    return (browser, driver) if browser and driver else None


@contextlib.contextmanager
def chromium(window: tuple[int, int] = (1280, 860)) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_binaries()
    if found is None:
        raise RuntimeError(
            "chromium and chromedriver are needed (Debian: chromium chromium-driver)"
        )
    browser, driver_path = found
    profile = tempfile.mkdtemp(prefix="markbase-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={window[0]},{window[1]}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        driver.set_window_size(*window)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
