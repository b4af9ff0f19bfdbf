"""Links the package prints open: the checkout's built site when there is one, else the published site."""

import re
from pathlib import Path

import pytest

from llmbook import bookpages, links

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_copies_of_the_urls_equal_config_yml():
    config = (ROOT / "_config.yml").read_text(encoding="utf-8")
    assert links.REPOSITORY_URL == bookpages.repository_url(ROOT / "_config.yml")
    baseurl = re.search(r"^html:\s*\n(?:[ \t]+.*\n)*?[ \t]+baseurl:\s*(\S+)", config, re.M)
    assert baseurl and baseurl.group(1) == links.SITE_URL


def test_without_a_built_site_a_page_links_to_the_published_site(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMBOOK_SITE_URL", raising=False)
    assert links.local_site(tmp_path) is None
    assert links.page_link("book/04-positions.html#sec-04-05", tmp_path) == \
        "https://llmbook.github.io/llmbook/book/04-positions.html#sec-04-05"
    monkeypatch.setenv("LLMBOOK_SITE_URL", "https://mirror.example/llmbook")  # a fork's pages: "/" is added
    assert links.page_link("book/01-probability.html", tmp_path) == "https://mirror.example/llmbook/book/01-probability.html"


def test_with_a_built_site_a_page_links_to_the_local_file(tmp_path):
    html = tmp_path / "_build" / "html"
    (html / "book").mkdir(parents=True)
    (html / "index.html").write_text("<html></html>")
    (html / "book" / "04-positions.html").write_text("<html></html>")
    link = links.page_link("book/04-positions.html#sec-04-05", tmp_path)
    assert link.startswith("file://") and link.endswith("/_build/html/book/04-positions.html#sec-04-05")
    assert links.page_link("book/99-none.html", tmp_path).startswith("https://")  # not built: the website


@pytest.mark.parametrize("page", ["", "/book/x.html", "https://example.com/x.html", 3])
def test_a_page_must_be_a_path_of_the_site(page):
    with pytest.raises(ValueError, match="path of the site"):
        links.page_link(page)
