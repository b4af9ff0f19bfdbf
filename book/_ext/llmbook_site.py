"""Small Sphinx fixes for the book's website (loaded through `sphinx: local_extensions` in _config.yml).

- sphinx-thebe 0.3.1 and sphinx-togglebutton add their inline configuration scripts twice under
  Sphinx 7 (once with filename None, once with ''), which makes the browser throw
  "Identifier 'THEBE_JS_URL' has already been declared" on every page. Identical scripts are
  dropped here, keeping the first.
- One execution per build: notebooks whose stored outputs nbval has proven current (a proof in
  ``_build/proofs`` whose key matches the notebook, the package and the pins; see
  :mod:`llmbook.freshness`) are rendered from their stored outputs; every other notebook is executed.
"""

from pathlib import Path

from sphinx.util import logging

logger = logging.getLogger(__name__)


def _key(js):
    filename = getattr(js, "filename", None) or ""
    attributes = tuple(sorted((k, str(v)) for k, v in getattr(js, "attributes", {}).items()))
    return filename, attributes


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for js in scripts:
        key = _key(js)
        if key in seen:
            continue
        seen.add(key)
        kept.append(js)
    scripts[:] = kept


def _render_proven_notebooks(app, config):
    from llmbook.coverage import book_notebooks
    from llmbook.freshness import plan

    root = Path(app.srcdir)
    proven, execute = plan(book_notebooks(root), root)
    config.nb_execution_excludepatterns = [*config.nb_execution_excludepatterns,
                                           *(p.resolve().as_posix() for p in proven)]
    logger.info(f"llmbook: {len(proven)} notebooks rendered from stored outputs proven current by nbval; "
                f"{len(execute)} executed now" + (f" ({', '.join(p.name for p in execute)})" if execute else ""))


def setup(app):
    app.connect("config-inited", _render_proven_notebooks)
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
