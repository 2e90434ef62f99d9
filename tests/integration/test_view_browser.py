"""``shoal view`` in a real headless Chromium against a real Mosquitto, over MQTT/WebSockets.

Debian's ``chromium`` and ``chromium-driver`` (``make bootstrap`` installs them) are driven by
Selenium through the system chromedriver: nothing is downloaded. The messages published are
the contract's golden outputs (schemas/golden/outputs), so the page reads what shoal sends.
The screenshot goes to the test's folder, or to ``SHOAL_VIEW_SCREENSHOT`` when set
(docs/view.png, in the README, is the page during a ``shoal up`` run instead).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from shoal._resources import resource_dir
from shoal.broker import AsyncSession
from shoal.broker.access import BrokerUser, Role
from shoal.broker.embedded import EmbeddedBroker
from shoal.broker.session import unique_client_id
from shoal.broker.settings import BrokerSettings
from shoal.schemas.topics import Topics
from shoal.view.server import PageConfig, ViewServer

pytestmark = pytest.mark.broker

GOLDEN = resource_dir("schemas") / "golden" / "outputs"
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")

Message = tuple[str, bytes, bool, Sequence[tuple[str, str]]]


def golden(name: str, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((GOLDEN / name).read_text())
    body.update(changes)
    return body


def as_json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def publish(settings: BrokerSettings, messages: Sequence[Message]) -> float:
    """Publish (QoS 1, each PUBACK awaited); the monotonic time the first publish began."""

    async def send() -> float:
        async with AsyncSession(settings, unique_client_id("test-view")) as session:
            began = time.monotonic()
            for topic, payload, retain, props in messages:
                await session.publish(topic, payload, retain=retain, user_properties=props)
            return began

    return asyncio.run(send())


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.fail("chromium/chromedriver missing: run `make bootstrap` (installs them with apt)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1500")
    options.accept_insecure_certs = True  # the secure profile's throwaway CA (wss://)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: WebDriver, timeout_s: float, what: str, check: Any) -> Any:
    return WebDriverWait(driver, timeout_s, poll_frequency=0.02).until(check, message=what)


def status(driver: WebDriver) -> str:
    return str(driver.find_element(By.ID, "status").get_attribute("data-state"))


def card_text(driver: WebDriver, pipeline: str, key: str) -> str:
    cards = driver.find_elements(
        By.CSS_SELECTOR, f'.key[data-pipeline="{pipeline}"][data-key="{key}"]'
    )
    return cards[0].text if cards else ""


def table_text(driver: WebDriver, table: str) -> str:
    return str(driver.find_element(By.ID, table).text)


def test_the_page_shows_pipelines_results_and_health_and_survives_a_broker_restart(
    browser: WebDriver, tmp_path: Path, topics: Topics
) -> None:
    with EmbeddedBroker("dev", data_dir=tmp_path / "broker", websockets=True) as broker:
        settings = broker.settings
        key = golden("result-key.json")  # pipeline temps, key t1
        publish(
            settings,
            [
                (
                    topics.pipeline_document("temps"),
                    (GOLDEN / "pipeline-document.json").read_bytes(),
                    True,
                    (),
                ),
                (topics.result_key("temps", "t1"), as_json(key), True, ()),
                (
                    topics.result_key("temps", "t2"),
                    as_json({**key, "key": "t2", "mean": 7.5}),
                    True,
                    (),
                ),
                # A pipeline started from its spec (shoal up): no document, but results.
                (topics.result_key("twin", "a"), as_json({**key, "pipeline": "twin"}), True, ()),
                (
                    topics.alert("hot", "too-warm", "t1"),
                    (GOLDEN / "alert-firing.json").read_bytes(),
                    True,
                    (),
                ),
                (
                    topics.gateway_status("gw-01"),
                    (GOLDEN / "gateway-status.json").read_bytes(),
                    True,
                    (),
                ),
            ],
        )
        with ViewServer(PageConfig(ws_url=broker.ws_url, root=topics.root)) as view:
            browser.get(view.url)
            # Connects, and fills in from the retained topics.
            wait(browser, 10, "connected", lambda d: status(d) == "connected")
            wait(browser, 5, "pipeline row", lambda d: "temps" in table_text(d, "pipelines"))
            assert "tumbling-10s" in table_text(browser, "pipelines")
            wait(browser, 5, "no document", lambda d: "twin" in table_text(d, "pipelines"))
            assert "twin \u2013 running (no document)" in table_text(browser, "pipelines")
            wait(browser, 5, "key cards", lambda d: card_text(d, "temps", "t2"))
            assert "mean 21.563" in card_text(browser, "temps", "t1")
            assert "mean 7.5 " in card_text(browser, "temps", "t2")
            assert "too-warm" in table_text(browser, "alerts")
            assert browser.find_element(By.ID, "alerts-firing").text == "1"

            # A value published now appears within a second.
            later = {**key, "start": key["start"] + 10_000, "end": key["end"] + 10_000}
            started = publish(
                settings,
                [(topics.result_key("temps", "t1"), as_json({**later, "mean": 42.4242}), True, ())],
            )
            wait(browser, 1.0, "new value", lambda d: "42.424" in card_text(d, "temps", "t1"))
            shown_after_s = time.monotonic() - started
            assert shown_after_s < 1.0

            # Health: heartbeats, late rows, dead letters (reason in a user property), and
            # a correction (revision 2).
            deadletter = (GOLDEN / "deadletter.msgpack").read_bytes()
            publish(
                settings,
                [
                    (
                        topics.metrics("worker", "w-1"),
                        (GOLDEN / "metrics-worker.json").read_bytes(),
                        False,
                        (),
                    ),
                    (
                        topics.metrics("combiner", "temps-0"),
                        (GOLDEN / "metrics-combiner.json").read_bytes(),
                        False,
                        (),
                    ),
                    (topics.late("temps"), (GOLDEN / "late.json").read_bytes(), False, ()),
                    (
                        topics.deadletter("temps"),
                        deadletter,
                        False,
                        (("reason", "bad_type"), ("code", "bad_type")),
                    ),
                    (
                        topics.result_key("temps", "t2"),
                        (GOLDEN / "result-key-correction.json").read_bytes(),
                        True,
                        (),
                    ),
                ],
            )
            wait(
                browser, 5, "reasons", lambda d: "bad_type" in d.find_element(By.ID, "reasons").text
            )
            assert "behind_watermark" in browser.find_element(By.ID, "reasons").text
            wait(
                browser, 5, "worker row", lambda d: "shoal-worker-temps" in table_text(d, "workers")
            )
            gateways = table_text(browser, "gateways")
            assert "gw-01" in gateways
            assert "1200 ms" in gateways
            assert "1400 ms" in gateways
            problems = table_text(browser, "problems")
            assert "temps 1 (total 2) 1 (total 2)" in problems
            wait(browser, 5, "correction", lambda d: "temps" in table_text(d, "corrections"))
            shot = Path(os.environ.get("SHOAL_VIEW_SCREENSHOT", tmp_path / "view.png"))
            assert browser.save_screenshot(str(shot))
            assert shot.stat().st_size > 10_000

            # The broker restarts: the page notices, reconnects by itself and goes on.
            broker.stop()
            wait(browser, 10, "disconnected", lambda d: status(d) != "connected")
            broker.start()
            started = time.monotonic()
            wait(browser, 15, "reconnected", lambda d: status(d) == "connected")
            publish(
                settings,
                [(topics.result_key("temps", "t1"), as_json({**later, "mean": 99.125}), True, ())],
            )
            wait(
                browser, 2, "value after restart", lambda d: "99.125" in card_text(d, "temps", "t1")
            )
            print(
                f"value shown {shown_after_s * 1000:.0f} ms after publishing; reconnected and "
                f"updated {time.monotonic() - started:.1f} s after the broker came back"
            )


def test_the_secure_profile_admits_dashboard_users_only_over_tls(
    browser: WebDriver, tmp_path: Path
) -> None:
    users = [
        BrokerUser("grafana", "right-password", Role.dashboard()),
        BrokerUser("ops", "ops-password", Role.admin()),  # right password, wrong role
        BrokerUser("comb", "comb-password", Role.combiner("temps")),
    ]
    topics = Topics()
    with EmbeddedBroker(
        "secure", data_dir=tmp_path / "broker", users=users, websockets=True
    ) as broker:
        assert broker.ws_url.startswith("wss://")
        combiner = broker.settings.with_credentials("comb", "comb-password")
        key = (GOLDEN / "result-key.json").read_bytes()
        publish(combiner, [(topics.result_key("temps", "t1"), key, True, ())])
        with ViewServer(PageConfig(ws_url=broker.ws_url, login=True, username="grafana")) as view:
            browser.get(view.url)
            login = browser.find_element(By.ID, "login")
            wait(browser, 5, "login form", lambda d: login.is_displayed())

            def log_in(user: str, password: str) -> None:
                for field, value in (("username", user), ("password", password)):
                    box = browser.find_element(By.ID, field)
                    box.clear()
                    box.send_keys(value)
                browser.find_element(By.ID, "connect").click()

            error = browser.find_element(By.ID, "login-error")
            for user, password in (("grafana", "wrong-password"), ("ops", "ops-password")):
                log_in(user, password)
                wait(browser, 10, f"{user} refused", lambda d: status(d) == "refused")
                assert error.is_displayed()
                assert "refused" in error.text
                # Mosquitto answers 0x87, Mochi a wrong password 0x86 (docs/brokers.md, 19).
                assert any(
                    reason in error.text
                    for reason in ("not authorized", "bad user name or password")
                ), error.text
                assert not browser.find_elements(By.CSS_SELECTOR, ".key")
            log_in("grafana", "right-password")
            wait(browser, 10, "connected", lambda d: status(d) == "connected")
            assert not error.is_displayed()
            assert not login.is_displayed()
            wait(browser, 5, "key card", lambda d: "mean 21.563" in card_text(d, "temps", "t1"))
