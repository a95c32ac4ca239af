"""The documentation: README.md stays a front door (at most 250 lines) and every relative link in
README.md and docs/*.md points to a file that exists (and, for a Markdown target with
``#anchor``, to a heading that exists). Reads the checkout's files only: no GPU, no torch."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

#: README's budget (issue 52): the reference, the design and the results live in docs/
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)

pytestmark = pytest.mark.skipif(not README.is_file() or not DOCS,
                                reason="README.md / docs/ not in this tree (an sdist or a wheel)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    return _CODE.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set:
    seen: dict = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _relative_links(path: Path):
    for target in _LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        yield target


def test_readme_is_a_front_door():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines, more than {README_MAX_LINES}: move reference material to "
        f"docs/ (api.md, distributed.md, design.md, results.md, decisions.md)")


def test_readme_links_the_docs():
    targets = set(_relative_links(README))
    for page in ("docs/api.md", "docs/distributed.md", "docs/design.md", "docs/results.md",
                 "docs/decisions.md", "docs/changelog.md"):
        assert any(t.split("#")[0] == page for t in targets), f"README.md does not link {page}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in _relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not bad, f"{page.relative_to(ROOT)}: broken links:\n  " + "\n  ".join(bad)


def test_no_session_journal():
    """docs/notes.md (a journal of sessions) was replaced by docs/decisions.md."""
    assert not (ROOT / "docs" / "notes.md").exists()
    assert (ROOT / "docs" / "decisions.md").is_file()


def test_one_logit_scale_limit():
    """The logit_scale limit is stated once, as the code has it: 88.72 for every dtype."""
    texts = {p.name: p.read_text(encoding="utf-8") for p in PAGES if p.name != "changelog.md"}
    assert not [n for n, t in texts.items() if "709.8" in t or "709.78" in t]
    assert "88.72" in texts["api.md"]
