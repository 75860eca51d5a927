"""Check the built documentation site (site/) in headless Chromium.

Serves site/ with `python -m http.server` on a free port and checks that every page loads
with no severe console entry and no broken image, that the search finds `autoscale`, and
that the `jsa.autoscale` entry of the API reference shows its signature.

Usage (after `scripts/build_docs.sh`; needs `pip install selenium` and Chromium with its
driver, e.g. Debian's `apt-get install chromium chromium-driver`):
    python scripts/check_site.py [--site site] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(site: pathlib.Path) -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=site,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url, timeout=1).close()
                break
            time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait()


def browser(chromium: str | None) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    if chromium:
        options.binary_location = chromium
    driver = shutil.which("chromedriver")
    service = webdriver.ChromeService(executable_path=driver) if driver else None
    return webdriver.Chrome(options=options, service=service)


def check_pages(driver: webdriver.Chrome, url: str, pages: list[str]) -> list[str]:
    problems = []
    for page in pages:
        driver.get(url + page)
        WebDriverWait(driver, 10).until(
            lambda d: d.execute_script("return document.readyState") == "complete"
        )
        for entry in driver.get_log("browser"):
            if entry["level"] == "SEVERE":
                problems.append(f"{page}: console: {entry['message']}")
        broken = driver.execute_script(
            "return Array.from(document.images)"
            ".filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"
        )
        problems += [f"{page}: image does not load: {src}" for src in broken]
    return problems


def check_search(driver: webdriver.Chrome, url: str) -> list[str]:
    driver.get(url)
    driver.find_element(By.CSS_SELECTOR, "label.md-search__icon, label[for='__search']").click()
    box = WebDriverWait(driver, 10).until(
        expected_conditions.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input"))
    )
    box.send_keys("autoscale")
    try:
        WebDriverWait(driver, 20).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
        )
    except Exception:
        return ["search: no result for 'autoscale'"]
    text = driver.find_element(By.CSS_SELECTOR, ".md-search-result").text
    return [] if "autoscale" in text else ["search: results do not mention autoscale"]


def check_signature(driver: webdriver.Chrome, url: str) -> list[str]:
    driver.get(url + "api/jsa/")
    heading = driver.find_elements(By.ID, "jax_scaled_arithmetics.autoscale")
    if not heading:
        return ["api/jsa/: no jsa.autoscale entry"]
    signature = driver.execute_script(
        "const h = document.getElementById('jax_scaled_arithmetics.autoscale');"
        "const s = h.parentElement.querySelector('.doc-signature');"
        "return s ? s.textContent : '';"
    )
    if "autoscale(" not in signature or "static_argnums" not in signature:
        return [f"api/jsa/: jsa.autoscale shows no signature ({signature[:80]!r})"]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=pathlib.Path, default=ROOT / "site")
    parser.add_argument("--chromium", default=shutil.which("chromium"))
    args = parser.parse_args()
    start = time.perf_counter()
    pages = sorted(
        str(p.relative_to(args.site).parent).replace(".", "") + "/"
        for p in args.site.rglob("index.html")
    )
    pages = [p.lstrip("/") for p in pages]
    with serve(args.site) as url:
        driver = browser(args.chromium)
        try:
            problems = check_pages(driver, url, pages)
            problems += check_search(driver, url)
            problems += check_signature(driver, url)
        finally:
            driver.quit()
    for problem in problems:
        print(problem)
    took = time.perf_counter() - start
    print(f"{len(pages)} pages checked in {took:.1f} s: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
