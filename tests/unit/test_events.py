"""The event hooks: each declared once in core/events.py and made per app, and a listener that
fails is logged and skipped instead of breaking the request that fired it."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from epd_flask.core import events
from epd_flask.core.events import EventHook, Events
from epd_flask.observe.families import Families
from epd_flask.observe.observer import MetricsObserver

PACKAGE = Path(events.__file__).resolve().parents[1]
#: Below observe/: none of these may load a metrics library.
BELOW_OBSERVE = ("core", "control", "upstream", "fleet", "serving")


def test_every_hook_knows_its_name_and_the_metrics_listen_to_each() -> None:
    hooks = Events().hooks()
    assert len(hooks) == 26
    assert all(h.name == name for name, h in hooks.items())
    assert not any(isinstance(v, EventHook) for v in vars(events).values())  # none per process
    app = Events()
    observer = MetricsObserver(Families(CollectorRegistry()))
    observer.listen(app)
    for name, hook in app.hooks().items():
        assert hook._listeners == (getattr(observer, name),), name
        assert not getattr(Events(), name)._listeners  # another app's hook hears nothing


def test_two_apps_hear_only_their_own_events() -> None:
    first, second = Events(), Events()
    heard: list[tuple[str, str, str]] = []
    first.evicted.add_listener(lambda role, url: heard.append(("first", role, url)))
    second.evicted.add_listener(lambda role, url: heard.append(("second", role, url)))
    second.evicted.fire("decode", "http://d:2")
    first.evicted.fire("prefill", "http://p:1")
    assert heard == [("second", "decode", "http://d:2"), ("first", "prefill", "http://p:1")]


def test_a_failing_listener_is_logged_and_the_next_one_still_hears(
        caplog: pytest.LogCaptureFixture) -> None:
    hook: EventHook[[str, str]] = EventHook("upstream_opened")
    heard: list[tuple[str, str]] = []

    def broken(role: str, url: str) -> None:
        raise RuntimeError("observer bug")

    hook.add_listener(broken)
    hook.add_listener(broken)  # idempotent
    hook.add_listener(lambda role, url: heard.append((role, url)))
    with caplog.at_level(logging.ERROR, logger="epd_flask.core.events"):
        hook.fire("decode", "http://d")
    assert heard == [("decode", "http://d")]
    assert [r.getMessage().split(" failed in ")[1] for r in caplog.records] == ["upstream_opened"]
    hook.remove_listener(broken)
    hook.fire("decode", "http://d")
    assert len(heard) == 2 and len(caplog.records) == 1


@pytest.mark.parametrize("layer", BELOW_OBSERVE)
def test_nothing_below_observe_imports_prometheus_client(layer: str) -> None:
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "prometheus_client" for n in names), path
