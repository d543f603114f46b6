"""The benchmarks write docs/benchmarks.md, each run into its own block: a synthetic run of
every writer against a copy of the page must change its own block and nothing else, so the
page keeps one latest block per benchmark (no diary of runs) and its explanations stay put.
The benchmarks themselves are not run here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fleet
import report
import run

#: Every block a benchmark writes, and who writes it.
BLOCKS = {"bench": "run.py", "fleet-light": "fleet.py", "fleet-loaded": "fleet.py",
          "fleetmodel-loaded": "fleetmodel.py", "fleetmodel-light": "fleetmodel.py",
          "hotpath": "hotpath.py", "upstream-call": "upstream_call.py",
          "relaycost": "relaycost.py", "kvpicture": "kvpicture.py", "soak": "soak.py",
          "fleet-trace": "tracereplay.py", "tenants": "tenants.py"}
BLOCK = re.compile(r"<!-- bench:([\w-]+):start -->\n.*?<!-- bench:\1:end -->", re.S)


def _blocks(text: str) -> dict[str, str]:
    found = [(m.group(1), m.group(0)) for m in BLOCK.finditer(text)]
    assert len({label for label, _ in found}) == len(found), "a block appears twice"
    return dict(found)


def _outside(text: str) -> str:
    return BLOCK.sub("<block>", text)


def _group(name: str, latencies: list[float], ttfts: list[float] | None = None) -> dict[str, Any]:
    return {"name": name, "completed": len(latencies), "errors": 0, "error_samples": [],
            "wall_s": 2.0, "latency_s": latencies, "ttft_s": ttfts or [],
            "max_gap_s": [0.02] * len(ttfts or [])}


def _run(target: str, cpu_s: float, latency: float) -> dict[str, Any]:
    return {"target": target, "requests": 100, "cpu_s": cpu_s, "sim_cpu_s": 0.05,
            "client_cpu_s": 0.01, "peak_rss_mb": 99.0,
            "groups": [_group("a32", [latency] * 100)]}


def _bench_text() -> str:
    meta = {"started": "2030-01-02T03:04:05+00:00", "finished": "2030-01-02T03:05:05+00:00",
            "machine": report.machine(), "load_after": (1.0, 1.0, 1.0),
            "router_version": "9.9.9", "epd_proxy": None,
            "command": report.recorded_command(".venv/bin/python tests/bench/run.py",
                                               ["--router", "/x/vllm-router"])}
    results = [{"workload": "a32", "what": "non-stream, synthetic", "runs": {
        "direct": [_run("direct", 0.0, 0.001)],
        "epd-flask": [_run("epd-flask", 0.1, 0.004)],
        "vllm-router": [_run("vllm-router", 0.025, 0.002)]}}]
    return report.render(meta, results)


def _fleet_text(scenario: fleet.Scenario) -> str:
    meta = {"started": "2030-01-02T03:04:05+00:00", "finished": "2030-01-02T03:05:05+00:00",
            "machine": report.machine(), "load_after": (1.0, 1.0, 1.0), "requests": 2,
            "sessions": 1, "seed": 14, "prompt_tokens": 200, "oracle": 100,
            "round_robin_computed": 150, "figures": dict(fleet.FIGURES),
            "command": ".venv/bin/python tests/bench/fleet.py", "router_version": None}
    rows = [{"target": name, "kind": "epd", "combined": False, "workers": 1, "sent": 2,
             "completed": 2, "errors": [], "ttft_p50": p50, "ttft_p99": 2 * p50,
             "itl_p99": 0.01, "computed": 120, "cached": 80, "vs_oracle": 1.2,
             "imbalance": 1.0, "work_imbalance": 1.0, "router_counters": {}}
            for name, p50 in (("epd round_robin", 0.5), ("epd prefix", 0.2))]
    return fleet.render(scenario, meta, rows)


def test_the_page_holds_one_block_per_benchmark_and_no_other() -> None:
    """No run of the past keeps a block of its own: every block is one a benchmark rewrites."""
    assert set(_blocks(report.PAGE.read_text())) == set(BLOCKS)
    bench = Path(report.__file__).parent
    for label, script in BLOCKS.items():
        assert f'"{label}"' in (bench / script).read_text() or script == "fleet.py", label
    assert {sc.label for sc in fleet.scenarios(False)} == {"fleet-light", "fleet-loaded"}


def test_each_writer_replaces_its_own_block_and_nothing_else(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    shutil.copyfile(report.PAGE, page)
    before = page.read_text()
    written = {
        "bench": _bench_text(),
        "fleet-light": _fleet_text(fleet.Scenario("light", 15.0, 3.0)),
        "fleet-loaded": _fleet_text(fleet.Scenario("loaded", 25.0, 4.0, 0.8)),
        "hotpath": report.stamp(report.now(), report.machine(), "python hotpath.py")
        + "\n| part | us |\n|---|---:|\n| app | 1.0 |\n",
    }
    for label, text in written.items():
        report.write_section(page, label, text)
        report.write_section(page, label, text)  # a second run replaces, never appends
    after = page.read_text()
    assert _outside(after) == _outside(before), "the prose around the blocks changed"
    old, new = _blocks(before), _blocks(after)
    assert set(new) == set(old)
    for label in old:
        if label in written:
            start, end = report.markers(label)
            assert new[label] == f"{start}\n{written[label].rstrip()}\n{end}"
        else:
            assert new[label] == old[label], label
    assert "on commit " in new["bench"] and "Command: `.venv/bin/python tests/bench/run.py " \
        "--router /x/vllm-router`" in new["bench"]
    assert "| a32: proxy CPU/request ≤ 3x vllm-router's | 1.00 vs 0.25 ms = 4.00x | no |" \
        in new["bench"]
    assert "Command: `.venv/bin/python tests/bench/fleet.py`" in new["fleet-loaded"]
    assert "`epd prefix` 200 ms, 0.40x `epd round_robin`" in new["fleet-loaded"]


def test_a_page_without_the_block_is_refused_and_left_alone(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Benchmarks\n\nprose\n")
    with pytest.raises(report.MissingSection):
        report.write_section(page, "bench", "figures\n")
    start, end = report.markers("bench")
    twice = f"{start}\na\n{end}\n\n{start}\nb\n{end}\n"
    page.write_text(twice)
    with pytest.raises(report.MissingSection):
        report.write_section(page, "bench", "figures\n")
    assert page.read_text() == twice
    scratch = tmp_path / "new" / "scratch.md"
    report.write_section(scratch, "bench", "figures\n")
    assert scratch.read_text() == f"# Benchmarks\n\n{start}\nfigures\n{end}\n"


def test_the_recorded_command_names_no_machine_paths() -> None:
    home = str(Path.home())
    got = report.recorded_command("python tests/bench/run.py", [
        "--router", f"{home}/.cache/bench-venv/bin/vllm-router", "--report",
        "/elsewhere/docs/benchmarks.md", "--json=/elsewhere/out.json", "--only", "a32,b",
        "--roster", f"{report.ROOT}/etc/roster.yaml", "--json", "/elsewhere/x.json",
        "--scenario", "two words"])
    assert got == ("python tests/bench/run.py --router ~/.cache/bench-venv/bin/vllm-router "
                   "--only a32,b --roster etc/roster.yaml --scenario 'two words'")


def test_a_partial_run_leaves_the_page_alone() -> None:
    page = str(report.PAGE)
    assert run.parse_args([]).report == page
    for partial in (["--only", "a32"], ["--quick"], ["--repeats", "1"],
                    ["--targets", "epd-flask"], ["--profile", "/elsewhere"]):
        assert run.parse_args(partial).report == "", partial
    assert run.parse_args(["--only", "a32", "--report", "x.md"]).report == "x.md"
    assert fleet.parse_args([]).report == page
    assert fleet.parse_args(["--scenario", "loaded"]).report == page
    for partial in (["--short"], ["--only", "prefix"], ["--seed", "3"], ["--rate", "2"]):
        assert fleet.parse_args(partial).report == "", partial
    assert fleet.parse_args(["--report", "/elsewhere/x.md", "--scenario", "light"]).command \
        == ".venv/bin/python tests/bench/fleet.py --scenario light"


def test_the_code_version_names_the_commit_and_changes_to_what_is_measured(
        tmp_path: Path) -> None:
    assert report.code_version(tmp_path) == "unknown code (not a git checkout)"

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
                        "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "epd_flask").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "epd_flask" / "a.py").write_text("x = 1\n")
    (tmp_path / "docs" / "benchmarks.md").write_text("# Benchmarks\n")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    clean = report.code_version(tmp_path)
    assert re.fullmatch(r"commit [0-9a-f]{7}", clean)
    (tmp_path / "docs" / "benchmarks.md").write_text("# Benchmarks\n\nfigures\n")
    assert report.code_version(tmp_path) == clean  # writing the page is not a code change
    (tmp_path / "epd_flask" / "a.py").write_text("x = 2\n")
    assert report.code_version(tmp_path) == clean + " with uncommitted changes"


#: Each micro-benchmark as ``make bench-micro`` runs it, made small: it must still run against
#: today's code (nothing else imports these scripts) and write its block.
MICRO = {
    "hotpath": ["-m", "gevent.monkey", "tests/bench/hotpath.py", "--multiprocess",
                "--calls", "20", "--repeats", "1"],
    "upstream-call": ["tests/bench/upstream_call.py", "--calls", "300", "--repeats", "1"],
    "relaycost": ["-m", "gevent.monkey", "--module", "tests.bench.relaycost", "--repeats", "1",
                  "--streams", "1", "--e2e-streams", "1"],
    "kvpicture": ["-m", "tests.bench.kvpicture", "--blocks", "512"],
    "fleetmodel-loaded": ["tests/bench/fleetmodel.py", "--seeds", "1", "--duration", "4"],
}


@pytest.mark.parametrize("label", sorted(MICRO))
def test_each_micro_benchmark_runs_and_replaces_its_block(tmp_path: Path, label: str) -> None:
    page = tmp_path / "benchmarks.md"
    shutil.copyfile(report.PAGE, page)
    before = page.read_text()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    subprocess.run([sys.executable, *MICRO[label], "--report", str(page)], cwd=report.ROOT,
                   env=env, check=True, capture_output=True, timeout=180)
    after = page.read_text()
    assert _outside(after) == _outside(before)
    old, new = _blocks(before), _blocks(after)
    assert {k for k in old if old[k] != new[k]} == {label}
    assert "Command: `.venv/bin/python " in new[label] and "--report" not in new[label]


def test_the_soak_table_puts_checkouts_side_by_side() -> None:
    """Two soaks in one table, a column each, every line a reader compares."""
    import argparse

    import soak

    from tests.chaos.harness import Outcome

    def one(label: str, lost: int, errors: list[str]) -> soak.Soak:
        s = soak.Soak(soak.Target(Path("."), "python", label))
        s.outcomes = [Outcome("r", "chat", 0.0, result="succeeded") for _ in range(9)] + \
            [Outcome("x", "chat", 0.0) for _ in range(lost)]
        s.abandoned, s.reloads, s.admin = 1, 10, [201, 200, 503]
        s.health_ms, s.rss_mb = [1.0, 2.0, 90.0], [(0, 60.0), (10, 61.0)]
        s.fds = [(0, 50), (10, 52)]
        s.log_errors = errors
        return s

    args = argparse.Namespace(seconds=600.0, rate=29.0, abandon=0.1, hup_every=60.0,
                              admin_every=30.0, workers=2)
    text = soak.render([one("commit aaaaaaa", 2, ["[ERROR] lock stayed locked"]),
                        one("commit bbbbbbb", 0, [])], args)
    assert "| | commit aaaaaaa | commit bbbbbbb |" in text
    assert "| lost (cut, reset, no answer) | 2 | 0 |" in text
    assert "| admin calls / answered 2xx | 3 / 2 | 3 / 2 |" in text
    assert "| ERROR lines or tracebacks in the log | 1 | 0 |" in text
    assert "First log errors of commit aaaaaaa" in text and "stayed locked" in text
