"""One declaration per setting: the README's tables, the roster schema, gunicorn's
configuration and the app all follow ``epd_flask/control/settings.py``, and nothing reads an
environment variable around it."""

from __future__ import annotations

import ast
import dataclasses
import re
import runpy
from pathlib import Path

import pytest

from epd_flask.control import settings
from epd_flask.control.config import ProxyConfig
from epd_flask.control.roster import RosterError, Settings, parse

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUNICORN_CONF = ROOT / "etc" / "gunicorn.conf.py"

#: gunicorn's setting name for each environment variable etc/gunicorn.conf.py passes on.
GUNICORN_SETTINGS = {
    "EPD_BIND": "bind", "EPD_WORKERS": "workers",
    "EPD_WORKER_CONNECTIONS": "worker_connections", "EPD_WORKER_TIMEOUT": "timeout",
    "EPD_GRACEFUL_TIMEOUT": "graceful_timeout", "EPD_KEEPALIVE": "keepalive",
    "FORWARDED_ALLOW_IPS": "forwarded_allow_ips", "EPD_ACCESS_LOG": "accesslog",
    "EPD_LOG_LEVEL": "loglevel", "EPD_PIDFILE": "pidfile",
}


def _table(header: str) -> list[list[str]]:
    """The rows of the README table whose header line is ``header``, cells stripped."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_the_readme_environment_table_lists_exactly_the_declared_variables() -> None:
    shown: dict[str, str] = {}
    for name_cell, default_cell, _meaning in _table("| environment | default | meaning |"):
        for name in re.findall(r"`([^`]+)`", name_cell):
            assert name not in shown, f"{name} has two rows in the README"
            shown[name] = default_cell
    assert sorted(shown) == sorted(settings.ENV)
    wrong = {n: (shown[n], v.shown_default()) for n, v in settings.ENV.items()
             if shown[n] != v.shown_default()}
    assert not wrong, f"README default vs declared (README, declared): {wrong}"


def test_the_readme_roster_settings_table_lists_exactly_the_declared_keys() -> None:
    rows = _table("| setting | default | unit | meaning |")
    shown = {re.sub(r"`", "", name): (default, unit) for name, default, unit, _ in rows}
    declared = settings.roster_rows()
    assert sorted(shown) == sorted(declared)
    wrong = {n: (shown[n], (s.shown_default(), s.unit)) for n, s in declared.items()
             if shown[n] != (s.shown_default(), s.unit)}
    assert not wrong, f"README (default, unit) vs declared: {wrong}"


def _check_schema(model: type, table: dict[str, settings.RosterSetting]) -> None:
    assert list(model.model_fields) == list(table)
    for name, decl in table.items():
        field = model.model_fields[name]
        assert field.description == decl.help, name
        if decl.keys:
            # A mapping of its own: absent (None) by default, its keys a model of them.
            assert field.default is None, name
            nested = field.annotation.__args__[0]
            _check_schema(nested, {k.name: k for k in decl.keys})
            continue
        assert field.default == decl.default and field.annotation == decl.type, name
        bounds = {k: getattr(m, k) for m in field.metadata for k in ("ge", "gt", "le")
                  if hasattr(m, k)}
        assert bounds == decl.bounds(), name


def test_the_roster_schema_is_the_declared_table() -> None:
    _check_schema(Settings, settings.ROSTER)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("decode_retries", 11, "settings field 'decode_retries': Input should be less than or "
                           "equal to 10"),
    ("connector", "tcp", "settings field 'connector': Input should be 'nixl', 'none', "
                         "'mooncake' or 'p2p_nccl'"),
    ("probe_interval", 0, "settings field 'probe_interval': Input should be greater than 0"),
    ("probe_intervall", 5, "settings field 'probe_intervall': unknown key"),
])
def test_a_bad_roster_setting_is_refused_with_its_key(key, value, words) -> None:
    with pytest.raises(RosterError) as err:
        parse({"settings": {key: value}}, "roster.yaml")
    assert str(err.value).startswith(f"roster.yaml: {words}")


def _bad_value(var: settings.EnvVar) -> str | None:
    if var.choices:
        return "bogus"
    return {int: "many", float: "soon", bool: "maybe"}.get(var.type)


CHECKED = [v for v in settings.ENV.values() if _bad_value(v) is not None]


@pytest.mark.parametrize("var", CHECKED, ids=[v.name for v in CHECKED])
def test_a_bad_value_is_one_error_naming_the_variable(var: settings.EnvVar) -> None:
    with pytest.raises(ValueError) as err:
        var.read({var.name: _bad_value(var)})
    message = str(err.value)
    assert message.startswith(f"{var.name} must ") and "\n" not in message


def test_bounds_and_messages_operators_already_know() -> None:
    for env, message in [
        ({"EPD_WORKER_CONNECTIONS": "0"}, "EPD_WORKER_CONNECTIONS must be positive, got 0"),
        ({"EPD_MAX_BODY_BYTES": "1e6"}, "EPD_MAX_BODY_BYTES must be a whole number, got '1e6'"),
        ({"EPD_DRAIN_IDLE_GRACE": "-1"}, "EPD_DRAIN_IDLE_GRACE must be positive, got '-1'"),
        ({"EPD_LOG_FORMAT": "XML"}, "EPD_LOG_FORMAT must be one of logfmt, json, got 'xml'"),
        ({"EPD_DEBUG_ENDPOINTS": "Maybe"},
         "EPD_DEBUG_ENDPOINTS must be one of on/off, true/false, 1/0; got 'maybe'"),
        ({"EPD_BODY_TIMEOUT": "inf"}, "EPD_BODY_TIMEOUT must be a finite number of seconds, "
                                      "got 'inf'"),
        ({"EPD_HEADER_TIMEOUT": "1e999"}, "EPD_HEADER_TIMEOUT must be a finite number of "
                                          "seconds, got '1e999'"),
        ({"EPD_UPSTREAM_IDLE_TIMEOUT": "nan"},
         "EPD_UPSTREAM_IDLE_TIMEOUT must be positive, got 'nan'"),
    ]:
        with pytest.raises(ValueError) as err:
            ProxyConfig.from_env(env)
        assert str(err.value) == message
    with pytest.raises(ValueError, match=r"^PORT must be at most 65535, got 99999$"):
        settings.read("PORT", {"PORT": "99999"})
    with pytest.raises(ValueError, match=r"^PORT must be a whole number, got 'http'$"):
        settings.read("PORT", {"PORT": "http"})
    assert settings.read("PORT", {"PORT": "65535"}) == 65535
    # gunicorn takes 0 for these (no heartbeat limit, no grace, no keep-alive), not -1.
    assert settings.read("EPD_KEEPALIVE", {"EPD_KEEPALIVE": "0"}) == 0
    with pytest.raises(ValueError, match="EPD_WORKER_TIMEOUT must not be negative, got -1"):
        settings.read("EPD_WORKER_TIMEOUT", {"EPD_WORKER_TIMEOUT": "-1"})


def test_defaults_that_depend_on_other_variables() -> None:
    assert settings.read("EPD_BIND", {}) == "127.0.0.1:8000"
    assert settings.read("EPD_BIND", {"HOST": "", "PORT": "9"}) == ":9"
    assert settings.read("EPD_BIND", {"EPD_BIND": "unix:/run/epd.sock", "PORT": "9"}) \
        == "unix:/run/epd.sock"
    assert settings.read("EPD_MAX_IN_FLIGHT", {"EPD_WORKER_CONNECTIONS": "10"}) == 9
    assert settings.read("EPD_MAX_IN_FLIGHT", {"EPD_WORKER_CONNECTIONS": "1"}) == 1
    assert ProxyConfig.from_env({}) == ProxyConfig()


def test_the_config_has_one_attribute_per_variable_the_app_reads() -> None:
    app_vars = [v for v in settings.ENV.values() if settings.APP in v.read_by]
    fields = {f.name: f for f in dataclasses.fields(ProxyConfig)}
    assert [v.attribute for v in app_vars] == list(fields)
    assert [v.attribute for v in app_vars if v.attr] == ["roster_path"]
    for var in app_vars:
        assert fields[var.attribute].default == var.default_value({}), var.name
    env = {"EPD_MAX_BODY_BYTES": "7", "EPD_ROSTER": "/x.yaml", "EPD_LOG_UPSTREAM": "on",
           "EPD_INSTANCE_NETWORKS": "10.0.0.0/8, 127.0.0.1/32", "EPD_STATE_DIR": "/s"}
    config = ProxyConfig.from_env(env)
    assert (config.max_body_bytes, config.roster_path, config.log_upstream,
            config.instance_networks, config.state_dir) \
        == (7, "/x.yaml", True, ("10.0.0.0/8", "127.0.0.1/32"), "/s")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_body_bytes = 8  # type: ignore[misc]


def test_serving_keys_from_the_variable_and_the_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# mounted secret\nk2\n  k3  \n\nk1\n")
    config = ProxyConfig.from_env({"EPD_API_KEYS": "k1,k2", "EPD_API_KEYS_FILE": str(keys)})
    assert config.api_keys == ("k1", "k2", "k3")
    assert ProxyConfig(api_keys_file=str(keys)).api_keys == ("k2", "k3", "k1")
    with pytest.raises(ValueError, match=r"EPD_API_KEYS_FILE .*/gone cannot be read: No such"):
        ProxyConfig.from_env({"EPD_API_KEYS_FILE": str(tmp_path / "gone")})
    with pytest.raises(ValueError, match="ADMIN_API_KEY must not also be a serving key"):
        ProxyConfig.from_env({"EPD_API_KEYS_FILE": str(keys), "ADMIN_API_KEY": "k3"})


def _gunicorn_config(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, object]:
    for name in settings.ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(GUNICORN_CONF))


def test_gunicorn_reads_the_declarations(monkeypatch: pytest.MonkeyPatch) -> None:
    conf = _gunicorn_config(monkeypatch, {})
    assert {n: conf[g] for n, g in GUNICORN_SETTINGS.items()} == {
        n: settings.ENV[n].default_value({}) for n in GUNICORN_SETTINGS}
    assert [n for n, v in settings.ENV.items() if settings.GUNICORN in v.read_by] \
        == [n for n in settings.ENV if n in GUNICORN_SETTINGS or n in ("HOST", "PORT")]
    conf = _gunicorn_config(monkeypatch, {"EPD_KEEPALIVE": "5", "PORT": "8123",
                                          "EPD_LOG_LEVEL": "DEBUG"})
    assert (conf["keepalive"], conf["bind"], conf["loglevel"]) == (5, "127.0.0.1:8123", "debug")
    with pytest.raises(ValueError, match="EPD_WORKER_CONNECTIONS must be a whole number"):
        _gunicorn_config(monkeypatch, {"EPD_WORKER_CONNECTIONS": "lots"})


# --- nothing reads an environment variable around the declarations ---------------------------

#: ``environ`` is also WSGI's name for a request, so only these are taken for the process's.
_PROCESS_ENV = {"env", "environment"}


def _environ_kind(node: ast.expr) -> str | None:
    """"process" for ``os.environ`` and a local ``env``; "maybe" for a name ``environ`` (the
    process's, or a WSGI request's); None for anything else."""
    if isinstance(node, ast.Attribute) and node.attr == "environ" \
            and isinstance(node.value, ast.Name) and node.value.id == "os":
        return "process"
    if isinstance(node, ast.Name):
        if node.id in _PROCESS_ENV:
            return "process"
        if node.id == "environ":
            return "maybe"
    return None


def _names_a_setting(key: ast.expr, kind: str | None) -> bool:
    """A declared or ``EPD_`` literal, a constant named like ``STATE_DIR_ENV``, or any
    computed key into the process's environment. WSGI keys (``PATH_INFO``) are not settings."""
    if kind is None:
        return False
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return key.value in settings.ENV or key.value.startswith("EPD_")
    ident = key.id if isinstance(key, ast.Name) else getattr(key, "attr", "")
    return bool(re.search(r"(^|_)ENV$", ident)) or kind == "process"


def _reads_env(node: ast.AST) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        func = node.func
        return func.attr == "getenv" or (
            func.attr in ("get", "pop", "setdefault") and bool(node.args)
            and _names_a_setting(node.args[0], _environ_kind(func.value)))
    if isinstance(node, ast.Subscript):
        return isinstance(node.ctx, ast.Load) \
            and _names_a_setting(node.slice, _environ_kind(node.value))
    if isinstance(node, ast.Compare):
        return any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) and any(
            _names_a_setting(node.left, _environ_kind(c)) for c in node.comparators)
    return False


def _env_reads(source: str) -> list[int]:
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.expr) and _reads_env(node))


def test_the_env_read_rule_can_fail() -> None:
    bad = ('import os\nos.environ.get("EPD_X")\nenv["EPD_ROSTER"]\nos.getenv("HOME")\n'
           'environ.get(STATE_DIR_ENV)\n"EPD_Y" in os.environ\nos.environ.get(name)\n'
           'environ.get("PORT")\n')
    ok = ('environ.get("PATH_INFO")\nos.environ[NAME] = "x"\nenv = os.environ\n'
          'environ[key]\nenviron.get(DP_RANK_HEADER)\n')
    assert _env_reads(bad) == [2, 3, 4, 5, 6, 7, 8]
    assert _env_reads(ok) == []


def test_only_the_declarations_read_the_environment() -> None:
    files = [*sorted((ROOT / "epd_flask").rglob("*.py")), *sorted((ROOT / "etc").glob("*.py")),
             ROOT / "wsgi.py", ROOT / "gunicorn.conf.py"]
    own = ROOT / "epd_flask" / "control" / "settings.py"
    found = [f"{p.relative_to(ROOT)}:{line}" for p in files if p != own
             for line in _env_reads(p.read_text(encoding="utf-8"))]
    assert not found, "environment read outside epd_flask/control/settings.py: " + str(found)
