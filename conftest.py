"""Let nbval run the book's chapters straight from their jupytext sources.

The chapters are MyST markdown notebooks (`book/chapters/NN_name.md`); no `.ipynb` is committed.
nbval only collects `.ipynb` files and reads them with `nbformat.read`, so for the chapter files we
hand nbval's own collector (`IPyNbFile`: one test item per code cell, one kernel per notebook) a
notebook read through `jupytext.read` instead.  Everything else (kernel, --nbval-lax, cell tags such
as `raises-exception` or `nbval-skip`) is nbval's unchanged behaviour.

    pytest --nbval-lax --nbval-current-env book/chapters

Only `book/chapters/*.md` is collected this way (never README.md, docs/, ...).
"""

from __future__ import annotations

from pathlib import Path


CHAPTERS = Path(__file__).resolve().parent / "book" / "chapters"

try:
    import jupytext
    import nbformat
    from nbval import plugin as _nbval_plugin
except ImportError:  # the book tools are not installed: nothing to collect
    _nbval_plugin = None


if _nbval_plugin is not None:

    class _NbformatViaJupytext:
        """Stands in for the `nbformat` module inside nbval's collector: `read` goes via jupytext."""

        @staticmethod
        def read(path, as_version=4):
            return jupytext.read(path, as_version=as_version)

        def __getattr__(self, name):
            return getattr(nbformat, name)

    class MarkdownNotebook(_nbval_plugin.IPyNbFile):
        """nbval's notebook collector, fed a jupytext MyST markdown file."""

        def collect(self):
            # nbval's collect() reads the file with `nbformat.read` on its first step; swap the
            # module it sees for as long as the collection generator runs.
            original = _nbval_plugin.nbformat
            _nbval_plugin.nbformat = _NbformatViaJupytext()
            try:
                yield from super().collect()
            finally:
                _nbval_plugin.nbformat = original


def pytest_collect_file(file_path: Path, parent):
    if _nbval_plugin is None or file_path.suffix != ".md":
        return None
    opt = parent.config.option
    if not (getattr(opt, "nbval", False) or getattr(opt, "nbval_lax", False)):
        return None
    if file_path.resolve().parent != CHAPTERS:
        return None
    return MarkdownNotebook.from_parent(parent, path=file_path)
