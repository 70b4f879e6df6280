"""Sphinx extension for the book: list each inline script once per page.

Sphinx 7.4 (the series Jupyter Book 1.x runs on) keeps two copies of an inline script
that an extension adds once the builder exists: one with filename None, one with ''.
sphinx-thebe's inline script declares ``const THEBE_JS_URL``, so its second copy is a
JavaScript SyntaxError on every page. This drops such exact duplicates.
"""


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    seen, kept = set(), []
    for js in scripts:
        key = (js.filename or "", js.priority, tuple(sorted(js.attributes.items())))
        if key not in seen:
            seen.add(key)
            kept.append(js)
    scripts[:] = kept


def setup(app):
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
