"""The documentation's links resolve and the README stays short.

Every relative Markdown link and image in README.md and docs/*.md must name a file or folder of the
repository, and every ``#anchor`` (in the same page or another Markdown page) a heading of that page,
with anchors made as GitHub makes them. Links inside code blocks and code spans are text, not links.
"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 200
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def pages() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md"))


def prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans (where brackets and '#' are not Markdown)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(FENCE.sub("", text)):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: str, root: str = ROOT) -> list[str]:
    """The relative links of ``page`` (a path under ``root``) that name no file, or no heading."""
    text = open(os.path.join(root, page), encoding="utf-8").read()
    problems = []
    for target in LINK.findall(prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...: not checked here
            continue
        path, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(os.path.join(root, page)), path)) if path else \
            os.path.join(root, page)
        if not os.path.exists(where):
            problems.append(f"{page}: ({target}): no file {os.path.relpath(where, root)}")
        elif anchor and where.endswith(".md"):
            if anchor not in anchors(open(where, encoding="utf-8").read()):
                problems.append(f"{page}: ({target}): {os.path.relpath(where, root)} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("page", pages())
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page) == []


def test_readme_reads_in_five_minutes():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    """The link check itself: a missing file, a missing anchor in the page and in another page are
    found; links in code, external links and GitHub's anchors of headings with markup pass."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## 3. Architecture (`pkg/`)\n\n## Same\n\n## Same\n")
    (tmp_path / "page.md").write_text(
        "# Page\n\n[ok](docs/other.md#3-architecture-pkg) [ok](docs/other.md#same-1) [ok](#page)\n"
        "[web](https://example.com/x) `[in code](missing.md)`\n\n```\n[in a block](missing.md)\n```\n"
        "[gone](docs/gone.md) [no heading](docs/other.md#nowhere) [no heading here](#nowhere)\n")
    problems = broken_links("page.md", root=str(tmp_path))
    assert [p.split(": ")[1] for p in problems] == ["(docs/gone.md)", "(docs/other.md#nowhere)", "(#nowhere)"]
