"""Where the book lives, for links printed by the package: a local build in a checkout, else the website.

``python -m llmbook ask`` and the coverage summary run in a checkout of the repository, or from an installed
package with no ``book/``, ``tests/`` or ``_build/`` beside it. A link must open in both cases:

- :data:`REPOSITORY_URL` and :data:`SITE_URL` are copies of ``_config.yml``'s ``repository: url:`` and
  ``html: baseurl:`` (``tests/test_links.py`` keeps them equal), because ``_config.yml`` is not installed;
- ``LLMBOOK_SITE_URL`` overrides the site, for a mirror or a fork's own pages;
- :func:`page_link` gives a page of the book (``book/04-positions.html#sec-04-03``, as the retrieval corpus
  stores it) as a ``file://`` URL of the checkout's built site when there is one (``make book``), and as a
  URL of the published site otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["REPOSITORY_URL", "SITE_URL", "site_url", "local_site", "page_link"]

#: The book's repository (``repository`` ``url`` in ``_config.yml``).
REPOSITORY_URL = "https://github.com/llmbook/llmbook"
#: The published website (``html`` ``baseurl`` in ``_config.yml``), ending in ``/``.
SITE_URL = "https://llmbook.github.io/llmbook/"


def site_url() -> str:
    """The website's base URL: ``LLMBOOK_SITE_URL`` if set, else :data:`SITE_URL` (always ending in ``/``).

    >>> site_url() == SITE_URL or "LLMBOOK_SITE_URL" in os.environ
    True
    """
    url = os.environ.get("LLMBOOK_SITE_URL", "").strip() or SITE_URL
    return url if url.endswith("/") else url + "/"


def local_site(root: Path | None = None) -> Path | None:
    """The checkout's built site (``_build/html`` with an ``index.html``), or None outside a checkout or before
    ``make book``."""
    if root is None:
        from llmbook.registry import repo_root

        root = repo_root()
    if root is None:
        return None
    html = Path(root) / "_build" / "html"
    return html if (html / "index.html").is_file() else None


def page_link(page: str, root: Path | None = None) -> str:
    """A link that opens ``page`` (a path of the site, such as ``book/04-positions.html#sec-04-03``).

    >>> import tempfile
    >>> page_link("book/04-positions.html#sec-04-03", root=Path(tempfile.mkdtemp())) == (
    ...     site_url() + "book/04-positions.html#sec-04-03")
    True
    """
    if not isinstance(page, str) or not page or page.startswith(("/", "http:", "https:", "file:")):
        raise ValueError(f"page must be a path of the site such as 'book/01-probability.html', got {page!r}")
    site = local_site(root)
    path, _, anchor = page.partition("#")
    if site is not None and (site / path).is_file():
        return (site / path).resolve().as_uri() + (f"#{anchor}" if anchor else "")
    return site_url() + page
