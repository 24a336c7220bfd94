"""Every relative link in README.md and docs/*.md reaches a file of the repository, and every anchor (`#...`) a
heading of the page it names, as GitHub renders it (its slug: lower case, punctuation dropped, spaces as hyphens; a
repeated heading's slug gets -1, -2, ...). A page moved, a heading reworded or a section renamed breaks a link
silently otherwise."""
import glob
import os
import re

import pytest
from conftest import REPO

PAGES = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: str) -> str:
    """The page without its fenced blocks and inline code (a link's syntax quoted there is not a link)."""
    text = re.sub(r"^```.*?^```", "", open(path).read(), flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, every character that is not a letter, a
    digit, a space, a hyphen or an underscore dropped, the spaces hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set:
    found, seen = set(), {}
    for line in re.sub(r"^```.*?^```", "", open(path).read(), flags=re.S | re.M).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links() -> list:
    """(page:line, target) of every relative link."""
    found = []
    for page in PAGES:
        for number, line in enumerate(prose(page).splitlines(), 1):
            for target in LINK.findall(line):
                if not re.match(r"[a-z]+:", target):  # (http:, https:, mailto: are not checked here)
                    found.append((f"{os.path.relpath(page, REPO)}:{number}", target))
    return found


def test_the_link_checker_finds_links_and_slugs_headings_as_github_does():
    assert len(links()) > 50
    assert slug("5. The speed-ups rerun on fresh seeds (registered before its runs)") == \
        "5-the-speed-ups-rerun-on-fresh-seeds-registered-before-its-runs"
    assert slug("Why `pace` keeps the bound") == "why-pace-keeps-the-bound"


@pytest.mark.parametrize("where, target", links(), ids=[f"{w} {t}" for w, t in links()])
def test_a_relative_link_resolves(where, target):
    page = os.path.join(REPO, where.rsplit(":", 1)[0])
    path, _, anchor = target.partition("#")
    destination = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    assert os.path.exists(destination), f"{where}: {target} names no file"
    if anchor:
        assert destination.endswith(".md"), f"{where}: {target}: an anchor into a file that is not a page"
        assert anchor in anchors(destination), f"{where}: {target}: no heading of {path or 'this page'} has it"
