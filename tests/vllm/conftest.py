"""The vLLM tier: real vLLM processes (CPU build, tiny local models) behind epd-flask under
gunicorn. Run it with `make test-vllm`, which builds the venv and models first and sets
EPD_VLLM_HOME; without a ready venv every test here is skipped, so `make test` stays light.

One topology (a pair of servers) runs at a time; modules are named so the ones sharing a
topology run one after another. The closing summary lists each case, its outcome and time,
and how long each topology took to become healthy.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm import fleet as fleet_mod
from tests.vllm import reap

ENV_SWITCH = "EPD_VLLM_HOME"
READY_STAMP = fleet_mod.VENV / ".epd-flask-ready"
_outcomes: list[tuple[str, str, float]] = []
_fleet_timings: dict[str, float] = {}
_stop_notes: list[str] = []


def _ready() -> bool:
    """Only `make test-vllm` (which sets EPD_VLLM_HOME) runs the tier, even where a venv
    from an earlier run is ready: plain `make test` must stay light."""
    return (ENV_SWITCH in os.environ and READY_STAMP.exists()
            and (fleet_mod.MODELS / ".complete").exists())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tier's modules carry the ``vllm`` marker (which setup.cfg's addopts deselect); an
    explicit ``-m vllm`` without `make test-vllm`'s set-up deselects them too."""
    ours = [item for item in items if "tests/vllm/" in item.nodeid.replace("\\", "/")]
    if ours and not _ready():
        config.hook.pytest_deselected(items=ours)
        items[:] = [item for item in items if item not in ours]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if "tests/vllm/" not in item.nodeid:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        verdict = "xfail" if hasattr(report, "wasxfail") else report.outcome
        _outcomes.append((item.nodeid.split("tests/vllm/", 1)[1], verdict, report.duration))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _outcomes:
        return
    tr = terminalreporter
    tr.section("vLLM tier summary")
    for name, seconds in _fleet_timings.items():
        tr.write_line(f"topology {name:<10} healthy after {seconds:6.1f} s")
    for nodeid, verdict, seconds in _outcomes:
        tr.write_line(f"{verdict.upper():<8} {seconds:6.2f} s  {nodeid}")
    for note in _stop_notes:
        tr.write_line(f"stopping: {note}")


@pytest.fixture(scope="session")
def fleet() -> Iterator[fleet_mod.Fleet]:
    for line in reap.reap(fleet_mod.RUN_DIR):  # leftovers of an interrupted earlier run
        print(f"reaped {line}")
    started = fleet_mod.Fleet()
    try:
        yield started
    finally:
        started.down()
        _fleet_timings.update(started.timings)
        _stop_notes.extend(started.stop_notes)
