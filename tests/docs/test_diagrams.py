"""The site's diagrams are drawn when it is read offline: a real browser (Debian's
Chromium, driven by Playwright) opens the built site served from this machine, with
every request elsewhere refused, and finds each diagram an SVG, not its source text.

A screenshot is kept in ``$ARTIFACTS_DIR`` (default ``tests/.artifacts``).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import threading
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT

playwright = pytest.importorskip("playwright.sync_api")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
#: The theme draws each diagram into a closed shadow root; opened here, so the test can
#: look inside. Nothing else on the page changes.
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) {
  return attach.call(this, { ...init, mode: "open" });
};
"""
#: Content delivery networks the site must not name (a link to read elsewhere is fine).
CDN = re.compile(r"unpkg\.com|cdn\.jsdelivr\.net|cdnjs\.cloudflare\.com|esm\.sh|googleapis\.com")

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="apt-get install chromium")


@pytest.fixture(scope="module")
def served(site):
    """The built site on a loopback port, as ``mkdocs serve`` or any web server serves it."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    thread.join(10)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:
        pass


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def test_the_built_site_names_no_cdn(site):
    named = [
        f"{file.relative_to(site)}: {found}"
        for file in site.rglob("*")
        if file.is_file() and file.suffix in {".html", ".js", ".css", ".json", ".map"}
        for found in set(CDN.findall(file.read_text(errors="replace")))
    ]
    assert named == []


def test_a_diagram_is_drawn_as_svg_with_the_network_cut_off(browser, served):
    context = browser.new_context(viewport={"width": 1200, "height": 1600})
    refused: list[str] = []

    def only_this_machine(route) -> None:
        if route.request.url.startswith(served):
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    context.route("**/*", only_this_machine)
    context.add_init_script(OPEN_SHADOW_ROOTS)
    page = context.new_page()
    try:
        page.goto(served + "how-to/beat/")
        diagram = page.locator("div.mermaid svg").first
        diagram.wait_for(timeout=30_000)
        assert "lease store" in diagram.text_content()  # a participant, drawn as SVG text
        assert page.locator("pre.mermaid").count() == 0
        assert "sequenceDiagram" not in page.locator("article").inner_text()
        assert diagram.bounding_box()["height"] > 200
        page.screenshot(path=str(artifacts() / "docs-diagram.png"), full_page=False)
        assert refused == []
    finally:
        context.close()


def artifacts() -> Path:
    folder = Path(os.environ.get("ARTIFACTS_DIR") or ROOT / "tests" / ".artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
