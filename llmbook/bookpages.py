"""Build helpers for the book: generated pages and in-place notebook execution.

``python -m llmbook pages`` writes ``book/equation-index.md`` (every registered equation with its
LaTeX, its chapter section and its function, filterable in the browser with no kernel) and
``book/status.md`` (coverage per chapter). ``python -m llmbook notebooks`` rewrites each chapter's
Colab install cell from the repository URL in ``_config.yml`` and re-executes the notebook in place.
"""

from __future__ import annotations

import html
import os
import re
import time
from pathlib import Path

from llmbook import chapters, coverage, registry

SETUP_TAG = "setup"
SETUP_TEMPLATE = '''\
# Set-up: on Colab, install llmbook from the book's repository; everywhere, fix seeds and style.
import sys

if "google.colab" in sys.modules:
    import importlib.util
    import subprocess

    if importlib.util.find_spec("llmbook") is None:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "llmbook[book] @ git+{url}"])

from llmbook.plotting import setup_notebook

setup_notebook()'''


def repository_url(config: Path | str = "_config.yml") -> str:
    """The repository URL from ``_config.yml`` (``repository: url:``), the one place it is set."""
    text = Path(config).read_text(encoding="utf-8")
    m = re.search(r"^repository:\s*\n(?:[ \t]+.*\n)*?[ \t]+url:\s*(\S+)", text, re.M)
    if not m:
        raise ValueError(f"{config} has no 'repository: url:' entry")
    return m.group(1)


def setup_cell_source(url: str) -> str:
    return SETUP_TEMPLATE.format(url=url)


# --------------------------------------------------------------------------- generated pages

_INDEX_HEAD = """\
# Equation index

Every equation that `llmbook` implements, with the section of the book that shows it and the
function that computes it. Type in the box to filter by id, name, family or a LaTeX symbol
(for example `softmax`, `09.`, `\\tau`). The page is generated from the registry by
`python -m llmbook pages`; coverage per chapter is on the [status page](status.md).

```{{raw}} html
<input id="eq-filter" type="search" placeholder="Filter equations..." aria-label="Filter equations"
       style="width:100%;padding:0.4em;margin:0.5em 0 1em 0;font-size:1em">
<p id="eq-count">{n} equations</p>
<table id="eq-table" class="table">
<thead><tr><th>id</th><th>equation</th><th>name</th><th>chapter</th><th>llmbook</th></tr></thead>
<tbody>
"""

_INDEX_TAIL = """\
</tbody></table>
<script>
(function () {
  var box = document.getElementById("eq-filter");
  var rows = Array.prototype.slice.call(document.querySelectorAll("#eq-table tbody tr"));
  var count = document.getElementById("eq-count");
  box.addEventListener("input", function () {
    var q = box.value.toLowerCase().trim(), shown = 0;
    rows.forEach(function (r) {
      var hit = !q || r.getAttribute("data-search").indexOf(q) >= 0;
      r.style.display = hit ? "" : "none";
      if (hit) { shown += 1; }
    });
    count.textContent = shown + " equations";
  });
})();
</script>
```
"""


def api_page_name(module: str) -> str:
    """The API page (without suffix) that documents ``module``: its chapter's, or the shared page.

    >>> api_page_name("llmbook.lm.attention"), api_page_name("llmbook.verify")
    ('api-03', 'api-shared')
    """
    ch = chapters.chapter_of_module(module)
    return f"api-{ch.number:02d}" if ch is not None else "api-shared"


def _api_anchor(where: str) -> tuple[str, str]:
    module, _, qualname = where.partition(":")
    return f"{module}.{qualname}", f"{api_page_name(module)}.html#{module}.{qualname}"


def equation_index(cov) -> str:
    rows = []
    cat = registry.catalogue()
    for eq_id, funcs in cov.implemented.items():
        e = cat[eq_id]
        shown = cov.shown.get(eq_id) if cov.shown else None
        if shown:
            page = Path(shown.notebook).with_suffix(".html").name
            chapter = f'<a href="{page}#{e.label}">{e.chapter}. {html.escape(e.family)}</a>'
        else:
            chapter = f"{e.chapter}. {html.escape(e.family)} (not yet shown)"
        code = ", ".join(f'<a href="{href}"><code>{html.escape(name)}</code></a>'
                         for name, href in map(_api_anchor, funcs))
        search = html.escape(" ".join([e.id, e.name, e.family, e.latex, *funcs]).lower(), quote=True)
        rows.append(
            f'<tr data-search="{search}"><td>{e.id}</td>'
            f'<td><span class="math notranslate nohighlight">\\({html.escape(e.latex)}\\)</span></td>'
            f"<td>{html.escape(e.name)}</td><td>{chapter}</td><td>{code}</td></tr>"
        )
    return _INDEX_HEAD.format(n=len(rows)) + "\n".join(rows) + "\n" + _INDEX_TAIL


def status_page(cov) -> str:
    """Coverage per chapter (:meth:`llmbook.coverage.Coverage.by_chapter`) and how each notebook was built."""
    from llmbook.coverage import book_notebooks
    from llmbook.freshness import BUDGET_S, read_proof

    lines = [
        "# Status",
        "",
        "Coverage of the catalogue, generated from the registry when the book is built: an equation",
        "is *implemented* when a function registers it, *tested* when a test in its module's mirrored",
        "test file compares that function with an independent oracle, and *shown* when the section",
        "labelled with its id in its chapter's notebook calls that function.",
        "",
        "| chapter | family | equations | implemented | tested | shown |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    tot = [0, 0, 0, 0]
    for r in cov.by_chapter():
        tested, shown = r.tested or 0, r.shown or 0
        tot = [tot[0] + r.total, tot[1] + r.implemented, tot[2] + tested, tot[3] + shown]
        lines.append(f"| {r.number} | {r.family} | {r.total} | {r.implemented} | {tested} | {shown} |")
    lines.append(f"| | **all** | **{tot[0]}** | **{tot[1]}** | **{tot[2]}** | **{tot[3]}** |")
    lines += [
        "",
        "## Execution",
        "",
        "Each notebook executes once per build. `make test` runs nbval, which re-executes every chapter and",
        "compares its outputs with the stored ones; a notebook that passes is rendered here from those",
        "stored outputs. Any other notebook (edited since the tests ran, or built without them) is",
        f"executed by the build itself. Each chapter has a budget of {BUDGET_S:.0f} s of execution on a",
        "2-core CPU.",
        "",
        "| notebook | outputs | cells | nbval execution |",
        "|---|---|---:|---:|",
    ]
    root = registry.repo_root() or Path(".")
    for nb in book_notebooks(root):
        proof = read_proof(nb, root)
        if proof:
            lines.append(f"| {nb.stem} | stored, proven by nbval ({proof['recorded']}) | {proof['cells']} | "
                         f"{proof['seconds']:.1f} s |")
        else:
            lines.append(f"| {nb.stem} | executed by this build | | |")
    lines += ["", "Notebooks executed by this build itself, if any:", "", "```{nb-exec-table}", "```"]
    return "\n".join(lines) + "\n"


def write_pages(book: str | Path = "book") -> list[Path]:
    book = Path(book)
    cov = coverage.coverage()
    out = []
    pages = [("equation-index.md", equation_index(cov)), ("status.md", status_page(cov)), *api_pages().items(),
             ("notation.md", notation_page())]
    for stale in book.glob("api-*.md"):  # a page of a module that has moved or gone
        stale.unlink()
    for name, text in pages:
        path = book / name
        path.write_text(text, encoding="utf-8")
        out.append(path)
    return out


# --------------------------------------------------------------------------- notebooks


def _refresh_setup_cell(nb, url: str) -> None:
    for cell in nb.cells:
        if cell.cell_type == "code" and SETUP_TAG in cell.metadata.get("tags", []):
            cell.source = setup_cell_source(url)
            return
    raise ValueError("notebook has no code cell tagged 'setup' (the Colab install and seeding cell)")


def coalesce_streams(outputs: list) -> list:
    """Merge consecutive outputs of the same stream into one, as Jupyter displays them.

    How a kernel splits a cell's prints into messages depends on timing (a loaded machine flushes
    more often), so without this the stored block count would differ between runs.

    >>> import nbformat
    >>> outs = [nbformat.v4.new_output("stream", name="stdout", text=t) for t in ("a\\n", "b\\n")]
    >>> [o.text for o in coalesce_streams(outs)]
    ['a\\nb\\n']
    """
    merged: list = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if (out.get("output_type") == "stream" and prev is not None and prev.get("output_type") == "stream"
                and prev.get("name") == out.get("name")):
            prev["text"] = prev["text"] + out["text"]
        else:
            merged.append(out)
    return merged


def execute_notebooks(paths: list[str] | None = None, timeout: int = 900) -> int:
    """Re-execute notebooks in place so that their stored outputs are current (what nbval compares)."""
    import nbformat
    from nbclient import NotebookClient

    os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in stored outputs (stderr)
    url = repository_url()
    nbs = [Path(p) for p in paths] if paths else sorted(Path("book").glob("*.ipynb"))
    for path in nbs:
        start = time.perf_counter()
        nb = nbformat.read(path, as_version=4)
        _refresh_setup_cell(nb, url)
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute()
        for cell in nb.cells:  # keep stored notebooks free of volatile metadata
            cell.metadata.pop("execution", None)
            if cell.cell_type == "code":
                cell.outputs = coalesce_streams(cell.outputs)
        nbformat.write(nb, path)
        print(f"executed {path} in {time.perf_counter() - start:.1f} s")
    return 0


def _api_modules() -> list[tuple[str, bool]]:
    """Every public module of the package (and whether it is a package), sorted by name."""
    import pkgutil

    import llmbook

    out = []
    for info in sorted(pkgutil.walk_packages(llmbook.__path__, prefix="llmbook."), key=lambda i: i.name):
        if any(part.startswith("_") for part in info.name.split(".")) or info.name in ("llmbook.cli",
                                                                                    "llmbook.bookpages"):
            continue
        out.append((info.name, info.ispkg))
    return out


def _automodule(name: str, ispkg: bool) -> list[str]:
    import importlib

    members = ["   :members:"]
    if ispkg:  # a package documents its own definitions only (re-exports live in their modules)
        mod = importlib.import_module(name)
        own = [v for k, v in vars(mod).items() if not k.startswith("_") and getattr(v, "__module__", "") == name]
        members = members if own else []
    return [f"## `{name}`", "", "```{eval-rst}", f".. automodule:: {name}", *members, "```", ""]


def api_pages() -> dict[str, str]:
    """The API reference, one page per chapter (its modules) plus one for shared infrastructure, and an index.

    One page for the whole package grew to 3.6 MB of HTML and about 1,800 formulas, which a browser on a
    2-core machine took over 20 s to load; a chapter's page is a few percent of that.
    """
    groups: dict[str, list[tuple[str, bool]]] = {}
    for name, ispkg in _api_modules():
        groups.setdefault(api_page_name(name), []).append((name, ispkg))
    pages, rows = {}, []
    for page in sorted(groups, key=lambda p: (p == "api-shared", p)):
        if page == "api-shared":
            title, lines = "Shared infrastructure", ["# API: shared infrastructure", ""]
            what = "the catalogue and registry, checks, plotting, the kernels' runtime, widgets, data"
        else:
            n = int(page[4:])
            nb = chapters.CHAPTERS[n].notebook
            title = f"Chapter {n}" + ("" if nb is None else f": {_chapter_title(nb)}")
            lines = [f"# API of chapter {n}" + ("" if nb is None else f": {_chapter_title(nb)}"), ""]
            if nb is not None:
                lines += [f"The modules of [chapter {n}]({Path(nb).name}), from their docstrings.", ""]
            what = ", ".join(f"`{m}`" for m, _ in groups[page])
        for name, ispkg in groups[page]:
            lines += _automodule(name, ispkg)
        pages[f"{page}.md"] = "\n".join(lines)
        rows.append(f"| [{title}]({page}.md) | {what} |")
    index = ["# API reference", "",
             "Generated from the docstrings of every `llmbook` module, one page per chapter (the modules the",
             "chapter manifest gives it) and one for what the chapters share.", "",
             "| page | modules |", "|---|---|", *rows, ""]
    return {"api.md": "\n".join(index), **pages}


def _chapter_title(notebook: str) -> str:
    """The first heading of a chapter notebook, without its number (``"Attention"``)."""
    import json

    path = Path(notebook)
    if not path.is_file():
        return path.stem
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    first = "".join(cells[0]["source"]).splitlines()[0] if cells else path.stem
    return first.lstrip("# ").split(". ", 1)[-1]


def notation_page() -> str:
    """The notation page, from ``llmbook/data/symbols.tsv`` (symbol, code name, meaning)."""
    import csv
    from importlib import resources

    text = resources.files("llmbook.data").joinpath("symbols.tsv").read_text(encoding="utf-8")
    rows = list(csv.DictReader(text.splitlines(), delimiter="\t", quoting=csv.QUOTE_NONE))
    lines = [
        "# Notation",
        "",
        "One set of symbols for the whole book, and the names the code gives them. Arrays are",
        "batch-first: a batch of token ids is `(B, T)`, the residual stream `(B, T, C)`, attention",
        "scores `(B, H, T, T)`, logits `(B, T, V)`. Logarithms are natural (nats) unless a name says bits.",
        "",
        "| symbol | in code | meaning |",
        "|---|---|---|",
    ]
    for r in rows:
        sym = r["symbol"].replace("|", "\\|")
        code = ", ".join(f"`{c.strip()}`" for c in r["code"].split(","))
        lines.append(f"| ${sym}$ | {code} | {r['meaning'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"
