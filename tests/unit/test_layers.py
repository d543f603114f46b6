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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
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


def _package_sources() -> dict[str, tuple[str, bool]]:
    return {_module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
            for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_lives_in_a_known_package() -> None:
    strays = [m for m in _package_sources() if _layer_of(m) not in (*LAYERS, APART, None)]
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


_MASTER_CHECK = """
import runpy, sys
for name in sys.argv[2:]:
    __import__(name)
runpy.run_path(sys.argv[1])
bad = sorted(m for m in ("ssl", "_ssl", "gevent") if m in sys.modules)
print(",".join(bad))
"""


def test_master_side_imports_neither_ssl_nor_gevent() -> None:
    """Run in a fresh interpreter: pytest itself runs gevent-patched."""
    assert MASTER_MODULES, "no control modules found"
    out = subprocess.run(
        [sys.executable, "-c", _MASTER_CHECK, str(ROOT / "etc" / "gunicorn.conf.py"),
         *MASTER_MODULES],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )
    assert out.stdout.strip() == "", (
        f"the master's imports load {out.stdout.strip()} (control: {MASTER_MODULES})")
