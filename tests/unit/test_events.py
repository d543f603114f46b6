"""The event hooks: each declared once in core/events.py, and a listener that fails is logged
and skipped instead of breaking the request that fired it."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from epd_flask.core import events
from epd_flask.core.events import EventHook
from epd_flask.observe.metrics import OBSERVER

PACKAGE = Path(events.__file__).resolve().parents[1]
#: Below observe/: none of these may load a metrics library.
BELOW_OBSERVE = ("core", "control", "upstream", "fleet", "serving")


def _hooks() -> dict[str, EventHook]:
    return {name: h for name, h in vars(events).items() if isinstance(h, EventHook)}


def test_every_hook_knows_its_name_and_the_metrics_listen_to_each() -> None:
    hooks = _hooks()
    assert len(hooks) == 19
    assert all(h.name == name for name, h in hooks.items())
    OBSERVER.listen()
    for name, hook in hooks.items():
        assert getattr(OBSERVER, name) in hook._listeners, name


def test_a_failing_listener_is_logged_and_the_next_one_still_hears(
        caplog: pytest.LogCaptureFixture) -> None:
    hook: EventHook[[str, str]] = EventHook()
    hook.name = "upstream_opened"
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
