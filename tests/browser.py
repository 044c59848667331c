"""Headless Chromium for the dashboards' tests: Playwright's sync API driving Debian's chromium.

Test modules load it with ``pytest_plugins = ["tests.browser"]`` and take the ``web`` fixture (a
fresh browser and page per test) and ``web_server`` (the control plane on a loopback port, serving
tiny-llama, with heartbeats fast enough that a stopped agent goes offline within seconds). In a
``web`` test, whose console errors and uncaught page errors fail the test,
with ``web.shot(name)`` saving a full-page screenshot to
``artifacts/screenshots/<test>/<name>.png`` and ``web.new_session()`` opening a second person's
page beside the first. Without Chromium (or Playwright) the test is
skipped with a loud reason, and the session's header and summary say so (tests/conftest.py).

Playwright's sync API runs an asyncio loop on the test's thread for as long as it is started, so
Django sees "an async context" there: the browser lives only as long as one test (so no other test
inherits that loop), and while it does, the test's own ORM calls are let through with
DJANGO_ALLOW_ASYNC_UNSAFE, as Playwright's documentation advises for Django. Tests must not call
``asyncio.run`` or ``async_to_sync`` on that thread.

It holds no assert, hence PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

from marketplace.nodes.joining import create_node
from marketplace.placement.selectors import servable_pipelines
from tests.live import LiveServer, wait_for
from worker_agent.dev.local import join_agent, stop_processes

MODEL = "tiny-llama"  # 6 layers: agents start in seconds
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser")
DEBIAN_CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = Path(__file__).resolve().parent.parent / "artifacts" / "screenshots"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
PASSWORD = "correct-horse-battery-staple-42"
MISSING_CHROMIUM = (
    "!!! CHROMIUM NOT FOUND: the web dashboard tests are SKIPPED. Install it (Debian: "
    "`apt-get install chromium`) so that `make test` runs them. !!!"
)
MISSING_PLAYWRIGHT = "!!! PLAYWRIGHT NOT INSTALLED: the web dashboard tests are SKIPPED (pip install '.[dev]'). !!!"


def chromium_path() -> str | None:
    """Debian's Chromium, or another on PATH; None when there is none."""
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return DEBIAN_CHROMIUM if os.access(DEBIAN_CHROMIUM, os.X_OK) else None


def missing_browser_reason() -> str | None:
    """Why the web tests cannot run here, or None when they can."""
    if chromium_path() is None:
        return MISSING_CHROMIUM
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return MISSING_PLAYWRIGHT
    return None


@dataclass
class Web:
    page: object  # playwright.sync_api.Page
    context: object  # playwright.sync_api.BrowserContext
    folder: Path
    url: str  # the live server's, e.g. http://127.0.0.1:PORT
    errors: list[str] = field(default_factory=list)
    provoked: list[str] = field(default_factory=list)  # console errors a test causes on purpose

    def provoke(self, text: str) -> None:
        """A console error the test causes on purpose (Chromium logs a refused request's status,
        e.g. "status of 402"), which then fails nothing."""
        self.provoked.append(text)

    def shot(self, name: str, page=None) -> Path:
        """A full-page screenshot of the page (or ``page``) as ``<folder>/<name>.png``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{name}.png"
        (page or self.page).screenshot(path=str(path), full_page=True)
        return path

    def phone(self, name: str) -> bool:
        """Screenshot the page at phone size and report whether it fits the width (no sideways
        scrolling of the page itself; wide tables scroll inside their own box); back to desktop after."""
        self.page.set_viewport_size(PHONE)
        try:
            self.page.wait_for_timeout(100)  # one layout pass
            self.shot(name)
            return bool(self.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"))
        finally:
            self.page.set_viewport_size(DESKTOP)

    def new_session(self):
        """A page in a fresh browser context (its own cookies: another person signed in beside the
        first), watched for errors like the first; closed with the browser."""
        context = self.context.browser.new_context(
            base_url=self.url, viewport=DESKTOP, locale="en-US", timezone_id="UTC"
        )
        page = context.new_page()
        self.watch(page)
        return page

    def watch(self, page) -> None:
        """Collect the page's console errors and uncaught exceptions."""

        def on_console(message) -> None:
            if message.type == "error" and not any(text in message.text for text in self.provoked):
                location = message.location or {}
                self.errors.append(f"console error on {page.url}: {message.text} ({location.get('url', '')})")

        page.on("console", on_console)
        page.on("pageerror", lambda error: self.errors.append(f"uncaught error on {page.url}: {error}"))


def _folder_for(node) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", node.name).strip("-")
    return SCREENSHOTS / name


@pytest.fixture
def web(request, monkeypatch, web_server):
    """A headless Chromium page (desktop size) on ``web_server`` for one test, closed before the
    server stops; its console errors fail the test."""
    reason = missing_browser_reason()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    folder = _folder_for(request.node)
    shutil.rmtree(folder, ignore_errors=True)
    playwright = sync_playwright().start()
    try:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=web_server.url, viewport=DESKTOP, locale="en-US", timezone_id="UTC")
            page = context.new_page()
            session = Web(page=page, context=context, folder=folder, url=web_server.url)
            session.watch(page)
            context.on("page", session.watch)
            yield session
            context.close()
        finally:
            browser.close()
    finally:
        playwright.stop()
    if session.errors:
        pytest.fail("the browser reported errors:\n" + "\n".join(session.errors), pytrace=False)


@pytest.fixture
def web_server(settings):
    """The whole ASGI app on a loopback port, in a thread of the test process (sharing its
    database): tiny-llama is the served model; a node silent for 4 s goes offline."""
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_COORDINATOR_LAUNCH = "inprocess"  # CI's REDIS_URL would send coordinators to Celery
    settings.SWARM_EMBEDDED_SCHEDULER = True
    settings.SWARM_HEARTBEAT_INTERVAL_S = 0.5
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 4.0
    settings.SWARM_SWEEP_INTERVAL_S = 0.5
    settings.SWARM_SPARES_PER_PIPELINE = 0
    settings.SWARM_COORDINATOR_REGIONS = ["local"]
    settings.SWARM_REGION_PROBE_URLS = {}
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # sign-ups in milliseconds
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tiny_pipeline(web_server, django_user_model, tmp_path):
    """Three tiny-llama agents of the provider "pat" (nodes gpu-0, gpu-1, gpu-2), capped at 2
    layers each so that they serve one pipeline of three stages; ready to serve. Yields the agents'
    processes, in the order of their nodes."""
    provider = django_user_model.objects.create_user("pat", "pat@example.test", PASSWORD, is_provider=True)
    processes = []
    try:
        for index in range(3):
            _, token = create_node(owner=provider, name=f"gpu-{index}")
            processes.append(
                join_agent(
                    web_server.url,
                    token,
                    tmp_path / f"n{index}.key",
                    tmp_path / f"agent{index}.log",
                    model=MODEL,
                    max_layers=2,
                )
            )
        wait_for(lambda: servable_pipelines(MODEL), 180, "a ready tiny-llama pipeline")
        yield processes
    finally:
        stop_processes(processes)


NANO = Decimal(1_000_000_000)


def dollars(nano: int, significant: int = 3) -> str:
    """Nano-dollars as every page shows money (written here apart from ``billing.display``, to check
    it): ``significant`` digits (three unless a table's column needs more), never fewer than cents,
    rounded half up."""
    amount = abs(Decimal(nano) / NANO)
    sign = "-" if nano < 0 else ""
    if amount == 0:
        return "$0.00"
    places = max(2, significant - 1 - amount.adjusted())
    whole, fraction = f"{amount.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP):,f}".split(".")
    return f"{sign}${whole}.{fraction.rstrip('0').ljust(2, '0')}"


def column_of_dollars(amounts: list[int]) -> list[str]:
    """A table's column of nano-dollar amounts as the pages show it: with the fewest significant
    digits (three at least) at which the amounts that differ read differently."""
    significant = 3
    while len({dollars(amount, significant) for amount in amounts}) < len(set(amounts)):
        significant += 1
    return [dollars(amount, significant) for amount in amounts]


def exact_dollars(nano: int) -> str:
    """Nano-dollars with every digit: the amount a page shows on hover."""
    return f"${(Decimal(nano) / NANO).normalize():,f}"


def floatformat(value: float, places: int) -> str:
    """A float as Django's ``floatformat`` filter shows it: rounded half up, fixed places."""
    return format(Decimal(repr(value)).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP), "f")


def sign_in(page, username: str) -> None:
    """Sign in through the login form with the tests' password; it lands on the home page."""
    page.goto("/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("/")


def sign_up(page, username: str, *, provider: bool = False, customer: bool = False) -> None:
    """Create an account through the sign-up form, as a person would; it lands on the home page."""
    page.goto("/signup/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Email").fill(f"{username}@example.test")
    page.get_by_label("Password", exact=True).fill(PASSWORD)
    page.get_by_label("Password confirmation").fill(PASSWORD)
    if provider:
        page.get_by_label("I provide GPUs (provider)").check()
    if customer:
        page.get_by_label("I buy inference (customer)").check()
    page.get_by_role("button", name="Sign up").click()
    page.wait_for_url("/")


def confirm(page, label: str) -> None:
    """Answer the page's confirmation dialog (an action that moves money or removes a node) with
    its confirm button, ``label``; the dialog closes."""
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("button", name=label).click()
    dialog.wait_for(state="hidden")


CUT_SHORT = """selector => {
    const element = document.querySelector(selector);
    return element !== null && element.scrollWidth > element.clientWidth;
}"""


def expect_cut_short(page, selector: str, timeout_ms: int = 10_000) -> None:
    """Wait until the element at ``selector`` is cut short (its text wider than its box). The
    element is looked up afresh on every try: a live update may swap the list it sits in, and an
    element read once, then swapped out, measures 0 by 0."""
    page.wait_for_function(CUT_SHORT, arg=selector, timeout=timeout_ms)
