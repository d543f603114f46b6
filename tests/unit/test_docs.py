"""The repository explains itself: comments and docs cite docs/behaviour.md, not codes.

Rule codes such as "P4" or "(R3)" named a catalogue that lives outside the repository, so a
reader could not look them up. Every citation is now a section of docs/behaviour.md, and this
test keeps it so: no such code may come back, and every cited section must exist.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "behaviour.md"
#: What the rules cover: the code, its tests, deployment files and every document.
SCOPE = ("epd_flask", "tests", "etc", "docs", "README.md", "ARCHITECTURE.md", "Makefile")
#: Captured wire traffic, not prose: whatever bytes vLLM sent.
DATA_DIRS = ("tests/sim/fixtures",)
#: The outside catalogue's codes exactly (roster R1-R6, multimodal M1-M7, prefill/decode
#: P1-P5, edge and transport T1-T9), as whole words: "P2P", "TTL" or "T0" do not match.
LABEL = re.compile(r"(?<![\w$])(?:R[1-6]|M[1-7]|P[1-5]|T[1-9])(?!\w)")
CITATION = re.compile(r"docs/behaviour\.md#([\w-]+)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
LOCAL_LINK = re.compile(r"\]\(#([\w-]+)\)")


def _files() -> list[Path]:
    """Tracked text files in scope (git's view, so build output and virtualenvs stay out)."""
    out = subprocess.run(["git", "ls-files", "-z", "--", *SCOPE], cwd=ROOT, check=True,
                         capture_output=True).stdout.decode().split("\0")
    files = []
    for name in filter(None, out):
        path = ROOT / name
        if name.startswith(DATA_DIRS) or not path.is_file():
            continue
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # images and other binary files
        files.append(path)
    return files


def _prose(path: Path) -> list[tuple[int, str]]:
    """The lines a reader reads as text: for Python, its comments and string literals only
    (a variable called ``P1`` in a test is code, not a citation); otherwise every line."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or \
                tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            out.extend(enumerate(tok.string.splitlines(), tok.start[0]))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]{2,}|`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors() -> set[str]:
    text = re.sub(r"```.*?```", "", SPEC.read_text(encoding="utf-8"), flags=re.DOTALL)
    found = [slug(h) for h in HEADING.findall(text)]
    duplicates = sorted({a for a in found if found.count(a) > 1})
    assert not duplicates, f"docs/behaviour.md repeats headings {duplicates}: anchors would shift"
    return set(found)


def test_slug_matches_github() -> None:
    assert slug("Encoders and rewriting") == "encoders-and-rewriting"
    assert slug("Connector: p2p_nccl") == "connector-p2p_nccl"
    assert slug("Prefill and decode") == "prefill-and-decode"


@pytest.mark.parametrize("text, cites", [
    ("retried (P4) before the first byte", True),
    ("# M4: the encoder's status", True),
    ("catalogue R1/R2", True),
    ("the rewrite (M1-M7)", True),
    ("T1: the body must be an object", True),
    ("P2P NCCL, TTL, T0=$(date), P10, R0", False),
    ('re.compile(r"[RMPT][0-9]")', False),
    ("x-data-parallel-rank, sha256, h2, TLSv1_2", False),
])
def test_label_pattern(text: str, cites: bool) -> None:
    assert bool(LABEL.search(text)) is cites


def test_no_outside_rule_codes() -> None:
    """Cite docs/behaviour.md#<section> instead (its sections: Roster, Routing, Health probes,
    Encoders and rewriting, Prefill and decode with one subsection per connector, Failover,
    Transport, Edge)."""
    me = Path(__file__).resolve()
    hits = [f"{path.relative_to(ROOT)}:{line}: {text.strip()}"
            for path in _files() if path.resolve() != me
            for line, text in _prose(path) if LABEL.search(text)]
    assert not hits, "rule codes from outside the repository:\n" + "\n".join(hits)


def test_cited_sections_exist() -> None:
    known = anchors()
    missing = [f"{path.relative_to(ROOT)}: #{anchor}"
               for path in _files()
               for anchor in CITATION.findall(path.read_text(encoding="utf-8"))
               if anchor not in known]
    local = [f"docs/behaviour.md: #{a}"
             for a in LOCAL_LINK.findall(SPEC.read_text(encoding="utf-8")) if a not in known]
    assert not missing + local, "cited sections missing from docs/behaviour.md:\n" + \
        "\n".join(missing + local)


def test_spec_has_its_sections() -> None:
    """The sections code comments are written against."""
    assert {"roster", "routing", "health-probes", "encoders-and-rewriting",
            "prefill-and-decode", "connector-nixl", "connector-none", "connector-mooncake",
            "connector-p2p_nccl", "failover", "transport", "edge"} <= anchors()
