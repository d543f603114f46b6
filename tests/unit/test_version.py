"""One version string, ``epd_flask.__version__``: the package metadata reads it and the
changelog has an entry for it, under the entry for what is not released yet."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import epd_flask

ROOT = Path(__file__).resolve().parents[2]
HEADING = re.compile(r"^## (.+)$", re.M)


def test_the_version_is_semantic_and_the_package_metadata_reads_it() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", epd_flask.__version__)
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert setup["metadata"]["version"] == "attr: epd_flask.__version__"


def test_the_changelog_has_unreleased_then_the_current_version_first() -> None:
    headings = HEADING.findall((ROOT / "CHANGELOG.md").read_text())
    assert headings[0] == "Unreleased"
    version, _, date = headings[1].partition(" - ")
    assert version == epd_flask.__version__
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date)
