"""The shipped deployment files agree with each other and with the code: the systemd unit,
the nginx server block, the Kubernetes example and the gunicorn settings they all wrap."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from epd_flask.control import settings
from epd_flask.control.roster import Settings, parse

ROOT = Path(__file__).resolve().parents[2]
ETC = ROOT / "etc"
K8S_VERSION = "1.30.0"
SIZE_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


def gunicorn_defaults() -> dict[str, Any]:
    """etc/gunicorn.conf.py as the master reads it with no EPD_* overrides."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("EPD_")}
    for key in saved:
        del os.environ[key]
    try:
        return runpy.run_path(str(ETC / "gunicorn.conf.py"))
    finally:
        os.environ.update(saved)


# -- systemd ---------------------------------------------------------------------------------

def unit_file(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections of key -> values (a key such as ExecReload may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_service_runs_gunicorn_gracefully_as_an_unprivileged_user() -> None:
    service = unit_file((ETC / "epd-flask.service").read_text())["Service"]
    env = dict(v.split("=", 1) for v in service["Environment"])
    assert service["User"][0] not in ("", "root") and service["Group"][0] not in ("", "root")
    # The installed wheel's command: it validates the roster, then execs the gunicorn master
    # with the packaged configuration; nothing is read from a checkout.
    assert service["ExecStart"] == ["/opt/epd-flask/venv/bin/epd-flask"]
    assert service["WorkingDirectory"] == ["/opt/epd-flask"]
    # Reload: validate first (a failing ExecReload stops the chain), then SIGHUP the master.
    assert service["ExecReload"][0].endswith("/epd-flask check-roster ${EPD_ROSTER}")
    assert service["ExecReload"][-1] == "/bin/kill -HUP $MAINPID"
    assert service["KillMode"] == ["mixed"] and service["KillSignal"] == ["SIGTERM"]
    assert service["Restart"] == ["on-failure"]
    graceful = int(env["EPD_GRACEFUL_TIMEOUT"])
    assert graceful == gunicorn_defaults()["graceful_timeout"]
    assert int(service["TimeoutStopSec"][0]) > graceful
    assert int(service["LimitNOFILE"][0]) >= 2 * gunicorn_defaults()["worker_connections"]
    for hardening in ("NoNewPrivileges", "PrivateTmp", "ProtectHome"):
        assert service[hardening] == ["yes"]
    assert service["ProtectSystem"] == ["strict"] and service["CapabilityBoundingSet"] == [""]
    assert env["EPD_ROSTER"].startswith(service["ReadWritePaths"][0] + "/")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_installed_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit as `make install-service` writes it, checked by systemd itself."""
    prefix = tmp_path / "opt"
    (prefix / "venv").mkdir(parents=True)
    (prefix / "venv" / "bin").symlink_to(Path(sys.executable).parent)
    unit = tmp_path / "epd-flask.service"
    subprocess.run(["make", "-s", "service-unit", f"PREFIX={prefix}", f"CONF_DIR={tmp_path}/etc",
                    "SERVICE_USER=epd-test", f"UNIT_OUT={unit}"], cwd=ROOT, check=True,
                   timeout=30)
    text = unit.read_text()
    assert f"ExecStart={prefix}/venv/bin/epd-flask\n" in text
    assert "User=epd-test" in text and "/opt/epd-flask" not in text
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True, timeout=60)
    # Unknown or misspelled keys are only warnings: any output at all is a finding.
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


def register_unit(prefix: str = "/opt/epd-flask") -> tuple[dict[str, list[str]], dict[str, str],
                                                         str]:
    """etc/epd-flask-register@.service: its [Service] section (continuation lines joined),
    the example settings file its comment shows, and its text with the install prefix
    replaced."""
    text = (ETC / "epd-flask-register@.service").read_text().replace("/opt/epd-flask", prefix)
    service = unit_file(re.sub(r"\\\n\s*", " ", text))["Service"]
    example = dict(m.groups() for m in re.finditer(r"^#\s+(EPD_REGISTER_\w+)=(.*)$", text, re.M))
    return service, example, text


def test_register_unit_runs_the_installed_command_on_its_example() -> None:
    """The example settings file, expanded as systemd does (``${X}`` one word, ``$X`` split),
    is a registration ``epd-flask register`` accepts; SIGTERM (which withdraws the record)
    stops it, as the unprivileged user, restarting it after any exit."""
    from epd_flask.fleet import registrant

    service, example, _ = register_unit()
    assert set(example) >= {"EPD_REGISTER_ETCD", "EPD_REGISTER_PREFIX", "EPD_REGISTER_ROLE",
                            "EPD_REGISTER_URL", "EPD_REGISTER_ARGS"}
    line = re.sub(r"\$\{(\w+)\}", lambda m: shlex.quote(example[m.group(1)]),
                  service["ExecStart"][0])
    line = re.sub(r"\$(\w+)", lambda m: example[m.group(1)], line)
    argv = shlex.split(line)
    assert argv[:2] == ["/opt/epd-flask/venv/bin/epd-flask", "register"]
    parser, fields = registrant.build_parser()
    opts = parser.parse_args(argv[2:])
    record = registrant.record_of(opts, fields)
    assert record.role == example["EPD_REGISTER_ROLE"]
    assert record.url == example["EPD_REGISTER_URL"]
    assert service["KillSignal"] == ["SIGTERM"] and service["Restart"] == ["always"]
    assert service["User"][0] not in ("", "root")
    assert service["EnvironmentFile"] == ["/etc/epd-flask/register/%i.env"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_register_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    prefix = tmp_path / "opt"
    (prefix / "venv").mkdir(parents=True)
    (prefix / "venv" / "bin").symlink_to(Path(sys.executable).parent)
    _, _, text = register_unit(str(prefix))
    unit = tmp_path / "epd-flask-register@decode-0.service"
    unit.write_text(text.replace("User=epd-flask", "User=epd-test")
                    .replace("Group=epd-flask", "Group=epd-test"))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


# -- nginx -----------------------------------------------------------------------------------

def nginx_directive(text: str, name: str, within: str | None = None) -> list[str]:
    if within is not None:
        block = re.search(rf"{within}\s*\{{(.*?)\n\}}", text, re.S)
        assert block, within
        text = block.group(1)
    return [m.group(1).strip() for m in re.finditer(rf"^\s*{name}\s+([^;]*);", text, re.M)]


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m|h)?", value)
    assert match, value
    return int(match.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[
        match.group(2)]


def test_nginx_and_gunicorn_timeouts_fit_together() -> None:
    conf = (ETC / "nginx.conf").read_text()
    gunicorn = gunicorn_defaults()
    # nginx closes idle upstream connections before gunicorn would.
    [idle] = nginx_directive(conf, "keepalive_timeout", within="upstream epd_flask")
    assert seconds(idle) < gunicorn["keepalive"]
    assert nginx_directive(conf, "keepalive", within="upstream epd_flask")
    # A stream may pause as long as epd-flask lets decode pause.
    [read] = nginx_directive(conf, "proxy_read_timeout")
    assert seconds(read) >= Settings().decode_timeout
    # A client that stops reading is dropped no later than epd-flask would drop it.
    [send] = nginx_directive(conf, "send_timeout")
    assert seconds(send) <= settings.default("EPD_CLIENT_WRITE_TIMEOUT")
    [size] = nginx_directive(conf, "client_max_body_size")
    number, unit = re.fullmatch(r"(\d+)([kmg]?)", size.lower()).groups()  # type: ignore[union-attr]
    assert int(number) * SIZE_UNITS[unit] >= settings.default("EPD_MAX_BODY_BYTES")


def test_nginx_streams_unbuffered_and_passes_request_ids() -> None:
    conf = (ETC / "nginx.conf").read_text()
    assert nginx_directive(conf, "proxy_buffering") == ["off"]
    assert nginx_directive(conf, "proxy_ignore_client_abort") == ["off"]
    assert nginx_directive(conf, "proxy_http_version") == ["1.1"]
    assert 'Connection ""' in nginx_directive(conf, "proxy_set_header")
    assert "X-Request-Id $epd_request_id" in nginx_directive(conf, "proxy_set_header")
    assert len(nginx_directive(conf, "server", within="upstream epd_flask")) >= 2
    [next_upstream] = nginx_directive(conf, "proxy_next_upstream")
    assert {"error", "non_idempotent"} <= set(next_upstream.split())


# -- Kubernetes ------------------------------------------------------------------------------

def k8s_documents() -> list[dict[str, Any]]:
    return [doc for path in sorted((ETC / "k8s").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_objects() -> dict[str, dict[str, Any]]:
    """The example's objects by kind; the Services by name (``Service`` is epd-flask's)."""
    docs: dict[str, dict[str, Any]] = {}
    for doc in k8s_documents():
        name = doc["metadata"]["name"]
        kind = doc["kind"]
        docs[kind if kind != "Service" or name == "epd-flask" else f"Service/{name}"] = doc
    return docs


def test_k8s_example_validates_against_the_kubernetes_schema() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    objects = k8s_objects()
    assert set(objects) == {"ConfigMap", "Deployment", "Service", "Service/vllm-prefill",
                            "Service/vllm-decode"}
    for doc in objects.values():
        kv.validate(doc, K8S_VERSION, strict=True)


def test_k8s_roster_finds_each_role_through_its_headless_service() -> None:
    """Membership is DNS (docs/behaviour.md#discovery): one headless Service per role, named
    in full in the roster with its port, listing only ready pods; nothing reads the Kubernetes
    API, so the pods carry no service account token and the example no RBAC."""
    objects = k8s_objects()
    data = objects["ConfigMap"]["data"]
    roster = parse(yaml.safe_load(data["roster.yaml"]), "etc/k8s/configmap.yaml")
    assert roster.instances == ()
    found = {}
    for entry in roster.sources["dns"]:
        service, namespace, *domain = entry.name.split(".")
        svc = objects[f"Service/{service}"]
        assert svc["metadata"]["namespace"] == namespace and domain == ["svc", "cluster", "local"]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"].get("publishNotReadyAddresses", False) is False
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == entry.role
        assert entry.port in [p["port"] for p in svc["spec"]["ports"]]
        found[entry.role] = entry
    assert set(found) == {"prefill", "decode"}
    kinds = {doc["kind"] for doc in k8s_documents()}
    assert not kinds & {"ServiceAccount", "Role", "ClusterRole", "RoleBinding",
                        "ClusterRoleBinding"}
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False


def test_k8s_example_keeps_the_admin_api_off_its_read_only_roster() -> None:
    """The roster is a ConfigMap, mounted read-only: the admin API, which writes the roster
    file, stays off there (gunicorn would refuse to start with ADMIN_API_KEY set; tests/e2e
    test_gunicorn starts it over this roster both ways)."""
    spec = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    app = next(c for c in spec["containers"] if c["name"] == "epd-flask")
    volumes = {v["name"]: v for v in spec["volumes"]}
    roster_dir = str(Path(env_of(app)["EPD_ROSTER"]).parent)
    mount = next(m for m in app["volumeMounts"] if m["mountPath"] == roster_dir)
    assert mount.get("readOnly") is True or "configMap" in volumes[mount["name"]]
    assert "ADMIN_API_KEY" not in env_of(app)
    assert not app.get("envFrom"), "a secret or ConfigMap could set ADMIN_API_KEY"


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def test_k8s_pieces_reference_each_other() -> None:
    objects = k8s_objects()
    deployment, service, configmap = (objects[k] for k in ("Deployment", "Service", "ConfigMap"))
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    spec = pod["spec"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    containers = {c["name"]: c for c in spec["containers"]}
    app, reloader = containers["epd-flask"], containers["roster-reloader"]
    port_names = {p["name"] for p in app["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    volumes = {v["name"]: v for v in spec["volumes"]}
    for container in containers.values():
        for mount in container["volumeMounts"]:
            assert mount["name"] in volumes
            assert "subPath" not in mount  # subPath mounts never see ConfigMap updates

    # The roster gunicorn reads is the ConfigMap's file, and the reloader watches that file.
    roster_mount = next(m for m in app["volumeMounts"]
                        if volumes[m["name"]].get("configMap", {}).get("name")
                        == configmap["metadata"]["name"])
    roster_path = env_of(app)["EPD_ROSTER"]
    assert Path(roster_path).parent == Path(roster_mount["mountPath"])
    assert Path(roster_path).name in configmap["data"]
    assert env_of(reloader)["ROSTER_FILE"] == roster_path

    # The reloader signals the master whose pid gunicorn writes to a volume both mount.
    pidfile = app["command"][app["command"].index("--pidfile") + 1]
    assert env_of(reloader)["PIDFILE"] == pidfile
    shared = {m["name"] for m in app["volumeMounts"] if pidfile.startswith(m["mountPath"] + "/")}
    assert shared & {m["name"] for m in reloader["volumeMounts"]}
    assert spec["shareProcessNamespace"] is True
    assert "runAsUser" in spec["securityContext"]  # one user for both: kill needs no capability
    assert app["command"][0] == "epd-flask"  # the wheel's command: nothing from a checkout

    # Streams get their graceful time before the kubelet's SIGKILL.
    graceful = int(env_of(app)["EPD_GRACEFUL_TIMEOUT"])
    assert graceful == gunicorn_defaults()["graceful_timeout"]
    pre_stop = app["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > graceful + int(pre_stop[1])
    # A read-only root filesystem: the state directory (gunicorn's control socket in it) and
    # worker heartbeats need a writable /tmp.
    assert app["securityContext"]["readOnlyRootFilesystem"] is True
    mounted = {m["mountPath"] for m in app["volumeMounts"]}
    assert "/tmp" in mounted and "EPD_STATE_DIR" not in env_of(app)
    assert "EPD_WORKERS" in env_of(app)
