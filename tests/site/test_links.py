"""No broken internal link or anchor anywhere on the built site (external links are not checked)."""

from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.site.conftest import SITE, _unavailable


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for key in ("href", "src"):
            if a.get(key) and (tag in ("a", "img", "script", "link")):
                self.links.append(a[key])


def _parse(path: Path) -> _Collect:
    c = _Collect()
    c.feed(path.read_text(encoding="utf-8", errors="replace"))
    return c


def test_no_broken_internal_links():
    if not (SITE / "book").is_dir():
        _unavailable("no built site: run `make book` first")
    pages = {p: _parse(p) for p in SITE.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts}
    broken = []
    for page, info in pages.items():
        for link in info.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith(("//", "mailto:", "javascript:", "data:")):
                continue
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(SITE)} -> {link}")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{page.relative_to(SITE)} -> {link} (no such anchor)")
    assert not broken, f"{len(broken)} broken internal links, e.g. {broken[:8]}"


@pytest.mark.parametrize("page", ["book/01-probability.html", "book/09-decoding.html"])
def test_chapter_equations_are_numbered_and_cross_referenced(page):
    if not (SITE / page).exists():
        _unavailable(f"{page} not built")
    html = (SITE / page).read_text(encoding="utf-8")
    assert 'class="eqno"' in html, "no numbered display equation"
    assert 'href="#equation-' in html or "href=\"01-probability.html#equation-" in html, "no {eq} cross-reference"
