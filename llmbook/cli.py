"""``python -m llmbook``: search the equation catalogue and report coverage.

Commands::

    python -m llmbook equations [QUERY]       search by id, name, family or LaTeX symbol
    python -m llmbook equations --summary     implemented / tested / shown per chapter
    python -m llmbook equations --missing     ids not yet implemented, tested or shown
    python -m llmbook pages                   write the generated book pages (index, status)
    python -m llmbook notebooks [PATH ...]    re-execute notebooks in place (stored outputs)
"""

from __future__ import annotations

import argparse
import sys

from llmbook import registry


def _mark(flag: bool | None) -> str:
    return "?" if flag is None else ("yes" if flag else "no")


def search(query: str) -> list[registry.Equation]:
    """Equations whose id, name, family or LaTeX contains ``query`` (case-insensitive).

    >>> [e.id for e in search("perplexity")]
    ['01.15']
    """
    q = query.lower().strip()
    out = []
    for e in registry.catalogue().values():
        hay = " ".join([e.id, e.name, e.family, e.latex]).lower()
        if q in hay or q == f"{e.chapter}" or q == f"{e.chapter:02d}":
            out.append(e)
    return out


def print_equations(query: str | None, cov: registry.Coverage, out=sys.stdout) -> int:
    eqs = search(query) if query else list(registry.catalogue().values())
    if not eqs:
        print(f"no equation matches {query!r}", file=out)
        return 1
    for e in eqs:
        print(f"{e.id}  {e.name}  (chapter {e.chapter}: {e.family})", file=out)
        print(f"    latex:     {e.latex}", file=out)
        funcs = cov.implemented.get(e.id)
        print(f"    function:  {', '.join(f.replace(':', '.') for f in funcs) if funcs else '-'}", file=out)
        if cov.tested is not None:
            tests = [f"{t.where} (oracle: {t.oracle or 'none named'})" for t in cov.tested.get(e.id, [])]
            print(f"    test:      {'; '.join(tests) if tests else '-'}", file=out)
        if cov.shown is not None:
            s = cov.shown.get(e.id)
            where = f"{s.notebook}#{e.label}" if s else "-"
            print(f"    chapter:   {where}", file=out)
    return 0


def summary_rows(cov: registry.Coverage):
    """(chapter, family, total, implemented, tested, shown) per chapter."""
    rows = []
    for ch, fam in sorted(registry.families().items()):
        ids = [e.id for e in registry.catalogue().values() if e.chapter == ch]
        impl = sum(i in cov.implemented for i in ids)
        tested = None if cov.tested is None else sum(bool(cov.is_tested(i)) for i in ids)
        shown = None if cov.shown is None else sum(bool(cov.is_shown(i)) for i in ids)
        rows.append((ch, fam, len(ids), impl, tested, shown))
    return rows


def print_summary(cov: registry.Coverage, out=sys.stdout) -> int:
    rows = summary_rows(cov)
    fmt = "{:>3}  {:<40} {:>5} {:>6} {:>6} {:>6}"
    print(fmt.format("ch", "family", "eqs", "impl", "tested", "shown"), file=out)
    untouched = []
    for ch, fam, n, impl, tested, shown in rows:
        if impl == 0 and not tested and not shown:
            untouched.append(ch)
            continue
        print(fmt.format(ch, fam[:40], n, impl, "?" if tested is None else tested,
                         "?" if shown is None else shown), file=out)
    if untouched:
        print(f"     {len(untouched)} chapters not started: {', '.join(map(str, untouched))}", file=out)
    total = sum(r[2] for r in rows)
    impl = sum(r[3] for r in rows)
    tested = "?" if cov.tested is None else sum(r[4] for r in rows)
    shown = "?" if cov.shown is None else sum(r[5] for r in rows)
    print(fmt.format("", "all chapters", total, impl, tested, shown), file=out)
    done = [r[0] for r in rows if r[2] == r[3] == r[4] == r[5]]
    print(f"complete chapters (implemented, tested and shown): {', '.join(map(str, done)) or 'none'}", file=out)
    if cov.unknown_ids:
        print(f"unknown ids referenced by tests or the book: {', '.join(cov.unknown_ids)}", file=out)
    return 0


def print_missing(cov: registry.Coverage, out=sys.stdout) -> int:
    for e in registry.catalogue().values():
        gaps = []
        if e.id not in cov.implemented:
            gaps.append("implementation")
        if cov.is_tested(e.id) is False:
            gaps.append("oracle test")
        if cov.is_shown(e.id) is False:
            gaps.append("book section")
        if gaps:
            print(f"{e.id}  {e.name:<45} missing: {', '.join(gaps)}", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmbook", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_eq = sub.add_parser("equations", help="search the catalogue and report coverage")
    p_eq.add_argument("query", nargs="?", help="id, name, family or LaTeX fragment")
    p_eq.add_argument("--summary", action="store_true", help="coverage per chapter")
    p_eq.add_argument("--missing", action="store_true", help="what is not yet covered")
    p_pages = sub.add_parser("pages", help="write the generated book pages")
    p_pages.add_argument("--book", default="book", help="book folder (default: book)")
    p_nb = sub.add_parser("notebooks", help="re-execute notebooks in place")
    p_nb.add_argument("paths", nargs="*", help="notebooks (default: every book/*.ipynb)")
    args = parser.parse_args(argv)

    if args.command == "equations":
        cov = registry.coverage()
        if args.summary:
            return print_summary(cov)
        if args.missing:
            return print_missing(cov)
        return print_equations(args.query, cov)
    if args.command == "pages":
        from llmbook import bookpages

        for path in bookpages.write_pages(args.book):
            print(f"wrote {path}")
        return 0
    if args.command == "notebooks":
        from llmbook import bookpages

        return bookpages.execute_notebooks(args.paths)
    return 2  # pragma: no cover
