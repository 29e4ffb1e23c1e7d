"""Small fixes to the HTML that Jupyter Book 1.x emits, so every page loads clean.

Loaded through `sphinx.local_extensions` in _config.yml.  What it does, and why:

* Thebe is off (`launch_buttons.thebe: false`), yet sphinx-thebe still adds its setup
  script to every page, twice (the second copy throws "Identifier 'THEBE_JS_URL' has
  already been declared"), plus a stylesheet and a `text/x-thebe-config` block.  All of
  it is removed.  Any other script or stylesheet emitted twice on a page is kept once.
* The book's own stylesheet (book/_static/fucina.css) is added to every page.

scripts/check_book.py loads every page in headless Chromium and fails on a console
error, a 404 or a request to another host: that is how these fixes are checked.
"""

from __future__ import annotations

from docutils import nodes

_THEBE_FILES = ("sphinx-thebe.js", "sphinx-thebe.css")


def _is_thebe(asset) -> bool:
    name = str(asset.filename or "")
    body = str(getattr(asset, "attributes", {}).get("body", ""))
    return name.endswith(_THEBE_FILES) or "THEBE_JS_URL" in body


def _dedup(assets) -> list:
    seen, kept = set(), []
    for asset in assets:
        attributes = tuple(sorted(getattr(asset, "attributes", {}).items()))
        key = (str(asset.filename or ""), attributes)
        if key not in seen:
            seen.add(key)
            kept.append(asset)
    return kept


def _clean_page(app, pagename, templatename, context, doctree):
    for key in ("script_files", "css_files"):
        if key in context:
            # a new list: the context's list is the builder's own, shared by all pages
            context[key] = _dedup(a for a in context[key] if not _is_thebe(a))


def _drop_thebe_config(app, doctree, docname):
    for node in list(doctree.findall(nodes.raw)):
        text = node.astext()
        if "text/x-thebe-config" in text or text.startswith("<script>kernelName ="):
            node.parent.remove(node)


def setup(app):
    app.add_css_file("fucina.css")
    app.connect("html-page-context", _clean_page, priority=900)
    # after sphinx-thebe's own handler (default priority 500) has added its nodes
    app.connect("doctree-resolved", _drop_thebe_config, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
