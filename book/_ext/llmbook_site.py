"""Small Sphinx fixes for the book's website (loaded through `sphinx: local_extensions` in _config.yml).

- sphinx-thebe 0.3.1 and sphinx-togglebutton add their inline configuration scripts twice under
  Sphinx 7 (once with filename None, once with ''), which makes the browser throw
  "Identifier 'THEBE_JS_URL' has already been declared" on every page. Identical scripts are
  dropped here, keeping the first.
"""


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


def setup(app):
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
