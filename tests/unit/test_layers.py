"""The package layering ARCHITECTURE.md draws, held by a test rather than by docstrings.

Two rules: a package imports only packages below it (so a request's code reads top to bottom
and no arrow runs back up), and whatever the gunicorn master imports loads neither ``ssl`` nor
``gevent`` (the master forks workers that gevent patches; ``ssl`` loaded before that patch, or
a gevent hub in the master, breaks them).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "epd_flask"

#: Bottom to top. Each package may import the ones before it, never the ones after.
#: ``wsgi`` is the module gunicorn's workers load: the app, built.
LAYERS = ("core", "control", "upstream", "fleet", "serving", "observe", "web", "app", "wsgi")
#: Stands apart: the simulated fleet imports nothing of the proxy, and the proxy nothing of it.
APART = "sim"
#: What the gunicorn master imports: the control package, which holds the gunicorn
#: configuration and the ``epd-flask`` command that becomes the master.
MASTER_MODULES = sorted(
    "epd_flask.control." + p.stem for p in (PACKAGE / "control").glob("*.py")
    if p.stem != "__init__"
)


def _layer_of(module: str) -> str | None:
    """``epd_flask.serving.connectors.nixl`` -> ``serving``; the package root -> None."""
    parts = module.split(".")
    if parts[0] != "epd_flask" or len(parts) == 1:
        return None
    return parts[1]


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(own: str, source: str, is_package: bool) -> list[tuple[int, str]]:
    """Every ``epd_flask`` module a source imports, anywhere in it (also inside functions)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # ``from epd_flask import serving`` names a package through its attribute.
            if module == "epd_flask":
                found += [(node.lineno, f"epd_flask.{a.name}") for a in node.names
                          if a.name in (*LAYERS, APART)]
    return [(line, m) for line, m in found if m.split(".")[0] == "epd_flask"]


def _upward_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """``sources`` maps a module name to its text and whether it is a package's __init__."""
    upward = []
    for own, (source, is_package) in sorted(sources.items()):
        here = _layer_of(own)
        if here is None:
            continue
        for line, module in _imports(own, source, is_package):
            there = _layer_of(module)
            if there is None or there == here:
                continue
            if APART in (here, there):
                upward.append(f"{own}:{line} {here} -> {there} (the simulator stands apart)")
            elif LAYERS.index(there) > LAYERS.index(here):
                upward.append(f"{own}:{line} {here} -> {there}")
    return upward


def _package_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """Every module of the ``epd_flask`` package under ``root``, by its dotted name."""
    return {_module_name(p, root): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
            for p in sorted((root / "epd_flask").rglob("*.py"))}


def _strays(sources: dict[str, tuple[str, bool]]) -> list[str]:
    return [m for m in sources if _layer_of(m) not in (*LAYERS, APART, None)]


def test_every_module_lives_in_a_known_package() -> None:
    strays = _strays(_package_sources())
    assert not strays, f"modules outside the layered packages: {strays}"


def test_no_package_imports_one_above_it() -> None:
    upward = _upward_imports(_package_sources())
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_the_layer_rule_sees_upward_and_sideways_imports() -> None:
    """The rule must be able to fail: each of these is caught, the downward one is not."""
    sources = {
        "epd_flask.control.bad": ("from epd_flask.serving import pipeline\n", False),
        "epd_flask.core.bad": ("def f():\n    from ..fleet import registry\n", False),
        "epd_flask.fleet.bad": ("import epd_flask.sim.app\n", False),
        "epd_flask.serving.ok": ("from epd_flask.fleet.registry import Registry\n", False),
    }
    assert _upward_imports(sources) == [
        "epd_flask.control.bad:1 control -> serving",
        "epd_flask.core.bad:2 core -> fleet",
        "epd_flask.fleet.bad:1 fleet -> sim (the simulator stands apart)",
    ]


def test_planted_files_are_caught_by_the_checks_the_real_tests_run(tmp_path: Path) -> None:
    """A package tree on disk with one upward import (relative, from a subpackage), one
    reach into the simulator and one module outside every layer: the same reading of files
    and the same rules as the tests above report each, and only those."""
    files = {
        "epd_flask/__init__.py": "",
        "epd_flask/fleet/__init__.py": "",
        "epd_flask/fleet/picks.py": "from ..upstream import transport\n",
        "epd_flask/serving/__init__.py": "",
        "epd_flask/serving/connectors/__init__.py": "",
        "epd_flask/serving/connectors/bad.py": "\n\nfrom ...web import api\n",
        "epd_flask/observe/bad.py": "from epd_flask import sim\n",
        "epd_flask/misc/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    sources = _package_sources(tmp_path)
    assert _upward_imports(sources) == [
        "epd_flask.observe.bad:1 observe -> sim (the simulator stands apart)",
        "epd_flask.serving.connectors.bad:3 serving -> web",
    ]
    assert _strays(sources) == ["epd_flask.misc"]


_MASTER_CHECK = """
import runpy, sys
for name in sys.argv[2:]:
    __import__(name)
runpy.run_path(sys.argv[1])
bad = sorted(m for m in ("ssl", "_ssl", "gevent") if m in sys.modules)
print(",".join(bad))
"""


def _master_loads(config: Path, modules: list[str], cwd: Path = ROOT) -> list[str]:
    """What of ssl and gevent a fresh interpreter has loaded after importing ``modules`` and
    running the gunicorn configuration file ``config``, as the master does (in a fresh
    interpreter because pytest itself runs gevent-patched)."""
    out = subprocess.run([sys.executable, "-c", _MASTER_CHECK, str(config), *modules],
                         cwd=cwd, capture_output=True, text=True, timeout=60, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_master_side_imports_neither_ssl_nor_gevent() -> None:
    assert MASTER_MODULES, "no control modules found"
    loaded = _master_loads(ROOT / "etc" / "gunicorn.conf.py", MASTER_MODULES)
    assert loaded == [], f"the master's imports load {loaded} (control: {MASTER_MODULES})"


def test_the_master_check_sees_ssl_and_gevent_wherever_they_are_loaded(tmp_path: Path) -> None:
    """The check must be able to fail: a control module that loads ssl (through an
    innocent-looking standard module), one that imports gevent, and a configuration file
    that does are each reported; clean ones are not."""
    (tmp_path / "planted").mkdir()
    (tmp_path / "planted" / "__init__.py").write_text("")
    (tmp_path / "planted" / "clean.py").write_text("import json, logging\n")
    (tmp_path / "planted" / "tls.py").write_text("import http.client\nimport urllib.request\n")
    (tmp_path / "planted" / "hub.py").write_text("def f():\n    pass\nimport gevent\n")
    clean_conf, bad_conf = tmp_path / "clean.conf.py", tmp_path / "bad.conf.py"
    clean_conf.write_text("workers = 2\n")
    bad_conf.write_text("import ssl\nworkers = 2\n")
    assert _master_loads(clean_conf, ["planted.clean"], cwd=tmp_path) == []
    assert _master_loads(clean_conf, ["planted.tls"], cwd=tmp_path) == ["_ssl", "ssl"]
    assert _master_loads(clean_conf, ["planted.hub"], cwd=tmp_path) == ["gevent"]
    assert _master_loads(bad_conf, ["planted.clean"], cwd=tmp_path) == ["_ssl", "ssl"]
