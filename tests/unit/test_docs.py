"""The repository explains itself: comments and docs cite its own documents, nothing outside.

A reader of this tree cannot look up an issue tracker's number, a work round's label, a path on
the machine the code was written on, or the rule codes of proxies that are not in the
repository. Every citation is a section of docs/behaviour.md or docs/benchmarks.md, and this
test keeps it so: a scanner over every tracked text file refuses each of those kinds (and
proves on planted text that it can), and every cited section must exist.
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
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
#: Captured wire traffic, not prose: whatever bytes vLLM sent.
DATA_DIRS = ("tests/sim/fixtures",)
#: The letter-and-digit rule codes of a behaviour catalogue kept outside the repository, as
#: whole words: "P2P", "TTL" or "T0" do not match.
LABEL = re.compile(r"(?<![\w$])(?:R[1-6]|M[1-7]|P[1-5]|T[1-9])(?!\w)")
#: What a reader of the repository cannot follow, by kind, each with what to write instead.
#: An upstream project's issue (``gevent#1957``) is a public citation and stays allowed.
OUTSIDE: dict[str, tuple[re.Pattern[str], ...]] = {
    "issue number (say what it means; cite docs/behaviour.md or docs/benchmarks.md)": (
        re.compile(r"\b(?:issues?|tickets?|pull requests?)[ -]?#?\d+\b", re.I),
        re.compile(r"\bPR ?#?\d+\b"),
        re.compile(r"\bthe issue(?:'s)?\b", re.I),
        re.compile(r"(?<![\w&/#:\"'])#\d+\b"),
    ),
    "work-round label (describe today's code; history goes to CHANGELOG.md)": (
        re.compile(r"\b(?:phase|round|session|wave|sprint|iteration|milestone)[ -]?\d+\b",
                   re.I),
        re.compile(r"\b(?:first|second|third|fourth|last) (?:round|phase|session) of\b", re.I),
    ),
    "path outside the repository (name it relative to the checkout)": (
        re.compile(r"/work/|\.\./shared\b|/home/\w|/root/|\bwt[-/]\w|\bworktrees?\b"),
    ),
    "reference proxy (describe the behaviour; cite docs/behaviour.md)": (
        LABEL,
        re.compile(r"\b(?:seed|reference) (?:proxy|proxies|router)\b", re.I),
    ),
}
CITATION = re.compile(r"docs/(behaviour|benchmarks)\.md#([\w-]+)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
LOCAL_LINK = re.compile(r"\]\(#([\w-]+)\)")


def _files() -> list[Path]:
    """Every tracked text file (git's view, so build output and virtualenvs stay out)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
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


def violations(path: Path, shown: str = "") -> list[str]:
    """Each line of ``path`` a reader would read that cites something outside the repository,
    as ``file:line: kind: text``."""
    out = []
    for line, text in _prose(path):
        for kind, patterns in OUTSIDE.items():
            if any(p.search(text) for p in patterns):
                out.append(f"{shown or path.name}:{line}: {kind}: {text.strip()}")
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]{2,}|`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path = SPEC) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.DOTALL)
    found = [slug(h) for h in HEADING.findall(text)]
    duplicates = sorted({a for a in found if found.count(a) > 1})
    assert not duplicates, f"{doc.name} repeats headings {duplicates}: anchors would shift"
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


def test_nothing_cites_what_is_not_in_the_repository() -> None:
    """Cite docs/behaviour.md#<section> (Roster, Routing, Health probes, Encoders and
    rewriting, Prefill and decode with one subsection per connector, Failover, Transport,
    Edge) or docs/benchmarks.md#<section> instead."""
    me = Path(__file__).resolve()
    hits = [hit for path in _files() if path.resolve() != me
            for hit in violations(path, str(path.relative_to(ROOT)))]
    assert not hits, "citations of what is not in the repository:\n" + "\n".join(hits)


PLANTED_PY = '''"""Planted: each kind the scanner refuses, and bait it must let pass."""

# The fix for issue 15 went in here.
DEBT = "see #42 and PR 7, as the issue's author wanted"
# Measured after-phase-2; before-session-3 it was slower (round 2).
NOTES = "/work/other/x.py and ../shared/notes.py"
# The seed proxy retries (P4) here.
P1 = "http://p1:8100"  # a variable of that name is code, not a citation
COLOR = "color:#111"  # CSS, not an issue; gevent#1957 is an upstream project's issue
STATE = "/tmp/epd-flask-state"  # a default the product itself documents
'''

PLANTED_MD = """# Planted

Per the issue's targets (issue #9), measured in the second round of work.
A seed proxy's probe path, reference proxies' rule T3.
Copied from /home/someone/notes and the worktree at /root/x.
The prober's first round runs at once; urllib3#3289 explains the queue.
"""


def test_the_scanner_reports_every_kind_on_planted_text(tmp_path: Path) -> None:
    """The scanner must be able to fail: planted Python (comments and strings only) and
    planted Markdown report each kind on the lines that hold it, and nothing on the bait."""
    py, md = tmp_path / "planted.py", tmp_path / "planted.md"
    py.write_text(PLANTED_PY)
    md.write_text(PLANTED_MD)
    found = violations(py) + violations(md)

    def lines(name: str, kind: str) -> list[int]:
        return [int(h.split(":")[1]) for h in found
                if h.startswith(name + ":") and h.split(": ", 2)[1].startswith(kind)]

    assert lines("planted.py", "issue number") == [3, 4]
    assert lines("planted.py", "work-round label") == [5]
    assert lines("planted.py", "path outside") == [6]
    assert lines("planted.py", "reference proxy") == [7]
    assert lines("planted.md", "issue number") == [3]
    assert lines("planted.md", "work-round label") == [3]
    assert lines("planted.md", "reference proxy") == [4]
    assert lines("planted.md", "path outside") == [5]
    assert not [h for h in found if h.split(":")[1] in ("8", "9", "10")
                and h.startswith("planted.py")], found
    assert not [h for h in found if h.startswith("planted.md:6:")], found


def test_cited_sections_exist() -> None:
    known = {"behaviour": anchors(SPEC), "benchmarks": anchors(BENCHMARKS)}
    missing = [f"{path.relative_to(ROOT)}: docs/{doc}.md#{anchor}"
               for path in _files()
               for doc, anchor in CITATION.findall(path.read_text(encoding="utf-8"))
               if anchor not in known[doc]]
    local = [f"docs/{doc.name}: #{a}" for doc in (SPEC, BENCHMARKS)
             for a in LOCAL_LINK.findall(doc.read_text(encoding="utf-8"))
             if a not in anchors(doc)]
    assert not missing + local, "cited sections missing:\n" + "\n".join(missing + local)


def test_spec_has_its_sections() -> None:
    """The sections code comments are written against."""
    assert {"roster", "routing", "health-probes", "encoders-and-rewriting",
            "prefill-and-decode", "connector-nixl", "connector-none", "connector-mooncake",
            "connector-p2p_nccl", "failover", "transport", "edge"} <= anchors()
