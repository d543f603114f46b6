"""The shipped Prometheus rules and Grafana dashboard as tests read them, and a real Prometheus
server (Debian's package) started on a free loopback port from the shipped prometheus.yml.

The dashboard's queries are taken from its JSON as Grafana would send them: the only template
variable they use, ``$job``, is replaced by the job being tested.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import requests
import yaml

from tests.helpers import eventually, free_port, stop_group

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "etc" / "prometheus"
RULES = PROMETHEUS_DIR / "epd-flask.rules.yml"
SHIPPED_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
DASHBOARD = ROOT / "etc" / "grafana" / "epd-flask.json"
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/usr/local/bin"])
START_TIMEOUT = 15.0
# In CI (.ci/run installs Debian's prometheus) a missing binary fails instead of skipping.
REQUIRED = os.environ.get("CI") == "true"
# A metric name of the proxy (not a recording rule's name, which has colons).
METRIC_NAME = re.compile(r"(?<![\w:])epd_[a-z_]+(?![\w:])")
RECORDED_NAME = re.compile(r"\b[a-z_]+:epd_[a-z_]+:[a-z0-9_]+\b")


def binary(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p.get("type") != "row"]


def dashboard_queries(job: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, as Grafana would query for ``job``."""
    return [(panel["title"], target["expr"].replace("$job", job))
            for panel in dashboard_panels() for target in panel["targets"]]


def derive_config(shipped: str, target: str, rules_file: Path, interval: str,
                  credentials_file: Path | None = None) -> str:
    """The shipped prometheus.yml scraping ``target`` with the given intervals, and with
    ``credentials_file`` its commented ``authorization`` block as an operator would fill it
    in: everything else (job name, rule file, label handling) is the operator's file."""
    config = yaml.safe_load(shipped)
    config["global"]["scrape_interval"] = interval
    config["global"]["evaluation_interval"] = interval
    assert config["rule_files"] == [RULES.name], "prometheus.yml should load the shipped rules"
    config["rule_files"] = [str(rules_file)]
    [job] = config["scrape_configs"]
    job["static_configs"] = [{"targets": [target]}]
    if credentials_file is not None:
        block = ("    # authorization:\n    #   type: Bearer\n"
                 "    #   credentials_file: /etc/prometheus/epd-flask-metrics.key\n")
        assert block in shipped, "prometheus.yml should show how to send the metrics key"
        job["authorization"] = {"type": "Bearer", "credentials_file": str(credentials_file)}
    return yaml.safe_dump(config)


class Prometheus:
    """One Prometheus server in its own process group, its data under ``workdir``."""

    def __init__(self, workdir: Path, target: str, interval: str = "1s",
                 credentials_file: Path | None = None) -> None:
        exe = binary("prometheus")
        assert exe, "prometheus is not installed, and CI=true requires the tests that use it"
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "prometheus.yml"
        self.config.write_text(derive_config(SHIPPED_CONFIG.read_text(), target, RULES,
                                             interval, credentials_file))
        self.log_path = workdir / "prometheus.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [exe, f"--config.file={self.config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready()

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def _wait_ready(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited early: {self.tail()}")
            return requests.get(self.url + "/-/ready", timeout=1).status_code == 200
        eventually(ready, START_TIMEOUT, interval=0.1, ignoring=(requests.RequestException,),
                   what=lambda: f"prometheus ready: {self.tail()}")

    def api(self, path: str, **params: str) -> Any:
        r = requests.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        doc = r.json()
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector ``promql`` returns now (its samples with a number, not NaN)."""
        return [s for s in self.api("query", query=promql)["result"]
                if not math.isnan(float(s["value"][1]))]

    def stop(self) -> None:
        stop_group(self.proc)
        self.log.close()
