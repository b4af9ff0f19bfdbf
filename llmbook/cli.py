"""``python -m llmbook``: search the equation catalogue and report coverage.

Commands::

    python -m llmbook equations [QUERY]       search by id, name, family or LaTeX symbol
    python -m llmbook equations --summary     implemented / tested / shown per chapter
    python -m llmbook equations --missing     ids not yet implemented, tested or shown
    python -m llmbook chapters                the chapter manifest (part, notebook, modules)
    python -m llmbook pages                   write the generated book pages (index, status)
    python -m llmbook notebooks [PATH ...]    re-execute notebooks in place (stored outputs)
    python -m llmbook train [--out DIR]       train the book's tiny GPT (llmbook/data/tiny_gpt.pt and its log)
    python -m llmbook corpus [--out PATH]     rewrite the snapshot of the book's prose (llmbook/data/book_corpus.jsonl)
                                             and the embedding cache (llmbook/data/minilm_cache.npz)
    python -m llmbook ask "what does RoPE do?" [-k 5] [--method hybrid|bm25|dense]
                                             search the book's prose offline with Part II's pipeline
    python -m llmbook cpu                     the numerical code paths this machine's libraries take
    python -m llmbook audit-checks [CC ...]   perturb each implementation, list the checks that still pass
                                             (report: book/check-audit.md)
"""

from __future__ import annotations

import argparse
import sys

from llmbook import chapters, coverage, registry


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


def print_equations(query: str | None, cov, out=sys.stdout) -> int:
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


def print_summary(cov, out=sys.stdout) -> int:
    """The per-chapter table of :meth:`llmbook.coverage.Coverage.by_chapter`.

    Outside a checkout (an installed package) there are no tests or notebooks to read: the table gives what
    the package itself knows, implemented equations per chapter, and says where the rest is measured.
    """
    if cov.tested is None and cov.shown is None:
        return _print_installed_summary(cov, out)
    rows = cov.by_chapter()
    fmt = "{:>3}  {:<40} {:>5} {:>6} {:>6} {:>6}"
    print(fmt.format("ch", "family", "eqs", "impl", "tested", "shown"), file=out)
    untouched = []
    for r in rows:
        if r.implemented == 0 and not r.tested and not r.shown and not r.notebook:
            untouched.append(r.number)
            continue
        print(fmt.format(r.number, r.family[:40], r.total, r.implemented, _count(r.tested), _count(r.shown)), file=out)
    if untouched:
        print(f"     {len(untouched)} chapters not started: {', '.join(map(str, untouched))}", file=out)
    total, impl = sum(r.total for r in rows), sum(r.implemented for r in rows)
    tested = "?" if cov.tested is None else sum(r.tested for r in rows)
    shown = "?" if cov.shown is None else sum(r.shown for r in rows)
    print(fmt.format("", "all chapters", total, impl, tested, shown), file=out)
    done = [r.number for r in rows if r.complete]
    print(f"complete chapters (implemented, tested and shown): {', '.join(map(str, done)) or 'none'}", file=out)
    if cov.unknown_ids:
        print(f"unknown ids referenced by tests or the book: {', '.join(cov.unknown_ids)}", file=out)
    return 0


def _print_installed_summary(cov, out) -> int:
    from llmbook.links import REPOSITORY_URL

    rows = cov.by_chapter()
    fmt = "{:>3}  {:<40} {:>5} {:>6}"
    print(fmt.format("ch", "family", "eqs", "impl"), file=out)
    for r in rows:
        print(fmt.format(r.number, r.family[:40], r.total, r.implemented), file=out)
    total, impl = sum(r.total for r in rows), sum(r.implemented for r in rows)
    print(fmt.format("", "all chapters", total, impl), file=out)
    full = [r.number for r in rows if r.total and r.implemented == r.total]
    print(f"chapters with every equation implemented: {len(full)} of {len(rows)}", file=out)
    print("tested and shown: not known here. The tests and the chapter notebooks are not part of the installed "
          f"package; in a checkout ({REPOSITORY_URL}), `python -m llmbook equations --summary` reads them.",
          file=out)
    return 0


def _count(n: int | None) -> str:
    return "?" if n is None else str(n)


def print_chapters(out=sys.stdout) -> int:
    """The chapter manifest: part, notebook and owning modules of every chapter."""
    for ch in chapters.CHAPTERS.values():
        family = registry.families()[ch.number]
        print(f"{ch.number:>2}  {ch.part:<6} {family}", file=out)
        print(f"    notebook: {ch.notebook or '-'}", file=out)
        print(f"    modules:  {', '.join(ch.modules) or '-'}", file=out)
    return 0


def print_missing(cov, out=sys.stdout) -> int:
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
    sub.add_parser("chapters", help="the chapter manifest: part, notebook and modules of each chapter")
    p_pages = sub.add_parser("pages", help="write the generated book pages")
    p_pages.add_argument("--book", default="book", help="book folder (default: book)")
    p_nb = sub.add_parser("notebooks", help="re-execute notebooks in place")
    p_nb.add_argument("paths", nargs="*", help="notebooks (default: every book/*.ipynb)")
    p_tr = sub.add_parser("train", help="train the book's models: the tiny GPT (default) or the assistant")
    p_tr.add_argument("--recipe", default="tiny-gpt", choices=("tiny-gpt", "assistant", "pg-cartpole", "pendulum"),
                      help="tiny-gpt: the character model on the corpus (a few minutes on 2 CPU cores); assistant: "
                           "tokenizer, pre-training, SFT, DPO and GRPO of the book's assistant (about 12 minutes); "
                           "pg-cartpole: PPO on CartPole-v1, 10 seeds (chapter 34); pendulum: DDPG, TD3 and SAC on "
                           "Pendulum-v1, 10 seeds (chapter 34)")
    p_tr.add_argument("--out", help="output folder (default: the package data folder, llmbook/data)")
    p_tr.add_argument("--steps", type=int, help="tiny-gpt only: train for fewer steps (a quick trial)")
    p_co = sub.add_parser("corpus", help="rewrite the retrieval corpus of the book's prose from book/ (Part II)")
    p_co.add_argument("--root", default=".", help="checkout root holding book/ (default: .)")
    p_co.add_argument("--out", help="output file (default: the package snapshot, llmbook/data/book_corpus.jsonl)")
    p_ask = sub.add_parser("ask", help="search the book's prose offline with Part II's retrieval pipeline")
    p_ask.add_argument("question", help="a question in plain words")
    p_ask.add_argument("-k", type=int, default=5, help="how many passages to print (default 5)")
    p_ask.add_argument("--method", default=None, choices=("hybrid", "bm25", "dense"),
                       help="hybrid (BM25 + MiniLM, z-score fusion), bm25 or dense; default: the one with the best "
                            "NDCG@10 on the dev questions (llmbook.rag.pipeline.DEFAULT_METHOD)")
    sub.add_parser("cpu", help="the numerical code paths of torch, MKL, OpenBLAS and NumPy on this machine")
    p_au = sub.add_parser("audit-checks", help="perturb each implementation by 1e-3 and list the checks of its "
                                                "section that still pass")
    p_au.add_argument("chapters", nargs="*", type=int, help="chapter numbers (default: all)")
    p_au.add_argument("--out", default="book/check-audit.md", help="the Markdown report (default: book/check-audit.md)")
    args = parser.parse_args(argv)

    if args.command == "equations":
        cov = coverage.coverage()
        if args.summary:
            return print_summary(cov)
        if args.missing:
            return print_missing(cov)
        return print_equations(args.query, cov)
    if args.command == "chapters":
        return print_chapters()
    if args.command == "pages":
        from llmbook import bookpages

        for path in bookpages.write_pages(args.book):
            print(f"wrote {path}")
        return 0
    if args.command == "audit-checks":
        from llmbook import audit

        return audit.main(args.chapters or None, args.out)
    if args.command == "notebooks":
        from llmbook import bookpages

        return bookpages.execute_notebooks(args.paths)
    if args.command == "train":
        if args.recipe != "tiny-gpt" and args.steps is not None:
            parser.error("--steps applies to the tiny-gpt recipe only")
        if args.recipe == "assistant":
            from llmbook.lm import assistant_recipe

            return assistant_recipe.main(args.out)
        if args.recipe == "pg-cartpole":
            from llmbook.agents import ppo_control

            return ppo_control.main(args.out)
        if args.recipe == "pendulum":
            from llmbook.agents import offpolicy_control

            return offpolicy_control.main(args.out)
        from llmbook.lm import training

        return training.main(args.out, args.steps)
    if args.command == "corpus":
        from pathlib import Path

        from llmbook.rag import corpus

        passages = corpus.build_corpus(args.root)
        out = Path(args.out) if args.out else Path(corpus.__file__).parent.parent / "data" / corpus.SNAPSHOT
        print(f"wrote {len(passages)} passages of {len({p.chapter for p in passages})} chapters to "
              f"{corpus.write_corpus(passages, out)}")
        if not args.out:
            from llmbook.rag import encoder, pipeline

            cache = out.parent / encoder.CACHE
            n, new = encoder.write_cache(pipeline.cache_texts(passages), cache)
            print(f"wrote {n} MiniLM embeddings ({new} newly computed) to {cache}")
        return 0
    if args.command == "ask":
        return ask(args.question, args.k, args.method)
    if args.command == "cpu":
        from llmbook.cpu import describe

        print(describe())
        return 0
    return 2  # pragma: no cover


def snippet(text: str, question: str, width: int = 280) -> str:
    """About ``width`` characters of ``text`` around the question's words: the sentences where they occur.

    The window starts at a sentence boundary and is the one that holds the most distinct query terms
    (:func:`llmbook.rag.sparse.analyze`), then the most in its first sentence; on a tie the earliest wins, so
    a passage that matches nowhere in particular shows its opening. ``...`` marks text cut at either end.

    >>> snippet("RoPE rotates pairs. " * 3 + "Attention sinks keep the first token.", "attention sinks", width=40)
    '...Attention sinks keep the first token.'
    """
    import re

    from llmbook.rag.sparse import analyze

    flat = " ".join(text.split())
    terms = set(analyze(question))
    starts = [0] + [m.end() for m in re.finditer(r"[.!?:;]\s+", flat)]
    ends = starts[1:] + [len(flat)]

    def hits(a: int, b: int) -> int:
        return len(terms.intersection(analyze(flat[a:b])))

    # most query terms in the window, then in its first sentence (so the window opens on a match)
    best = max(zip(starts, ends, strict=True), key=lambda se: (hits(se[0], se[0] + width), hits(*se)))[0]
    piece = flat[best:best + width]
    if best + width < len(flat):
        piece = piece.rsplit(" ", 1)[0] + "..."
    return ("..." if best else "") + piece


def ask(question: str, k: int = 5, method: str | None = None) -> int:
    """Print the book's best passages for ``question`` with their chapter, link, score and a snippet.

    ``method`` ``None`` is the dev winner, :data:`llmbook.rag.pipeline.DEFAULT_METHOD`."""
    import textwrap

    from llmbook.links import local_site, page_link
    from llmbook.rag import encoder, pipeline

    method = pipeline.DEFAULT_METHOD if method is None else method

    if method != "bm25" and isinstance(question, str) and question.strip() and encoder.needs_model([question]):
        print("loading the MiniLM sentence encoder (all-MiniLM-L6-v2) to embed a new question: once per process, "
              "a few seconds...", file=sys.stderr, flush=True)
    try:
        hits = pipeline.search(question, k=k, method=method)
    except ImportError as e:  # no sentence encoder installed: say so, fall back to BM25
        print(f"note: {e}; falling back to --method bm25", file=sys.stderr)
        method, hits = "bm25", pipeline.search(question, k=k, method="bm25")
    except ValueError as e:  # an empty question or k < 1: the message, not a traceback
        print(f"llmbook ask: {e}", file=sys.stderr)
        return 2
    what = {"hybrid": "BM25 + MiniLM, z-score fusion", "bm25": "BM25", "dense": "MiniLM cosine"}[method]
    print(f"{question}\n({what} over {len(pipeline.book_data().passages)} passages of the book)\n")
    if not hits:
        print("no passage shares a word with the question")
    for h in hits:
        p = h.passage
        print(f"{h.rank:>2}. [{h.score:.3f}] chapter {p.chapter}: {p.heading}")
        print(f"    {page_link(p.url)}")
        print(textwrap.indent(textwrap.fill(snippet(p.text, question), 96), "    "))
    if hits and local_site() is None:
        print("\nlinks go to the published book; in a checkout, `make book` builds it locally and the links "
              "then open the local pages")
    return 0
