"""freetoken_patch.report: `ftpatch bench` results (JSON) -> a page, charts and the README table.

- `data` — load result files (`load`), the charts' series with each point's JSON pointer
  (`charts`), the per-cap summary (`summary`), every number of a file (`figures`).
- `html` — `page(sources)`: one self-contained HTML page (SVG charts, inline script, JSON embedded).
- `png` — `write(sources, dir)`: the same charts as PNG (matplotlib, `pip install 'ftpatch[report]'`).
- `markdown` — `table`, `block`, `replace_block`: the README's results table between markers.
"""
from . import data, html, markdown, png

__all__ = ["data", "html", "markdown", "png"]
