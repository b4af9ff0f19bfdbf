"""The book's own prose as a retrieval corpus, and a labelled query set over it (Part II).

A **passage** is a piece of one chapter notebook's markdown: the cells are cut at every MyST target
``(sec-CC-NN)=`` and every ``#``/``##`` heading into *blocks* (one per section of the web page), and a
block is cut again at cell boundaries, a piece shorter than :data:`MIN_CHARS` joining the one before
it. Each passage carries

========  ====================================================================================
id        ``"09-decoding#sec-09-04/0"``: notebook stem, web anchor, index within the anchor (stable
          while the prose of other sections changes)
chapter   the chapter number (``9``)
section   the MyST target that governs it (``"sec-09-04"``; ``"sec-08-training"`` for an unnumbered
          one), or ``None`` for a title block or an untargeted heading such as "Try it"
heading   the block's heading as plain text ("Nucleus (top-p) sampling (09.04)")
text      plain text: targets, equation labels, directive fences and markdown markup removed,
          ``{cite}`` roles as ``[key, key]``, ``{ref}`` roles as their text; LaTeX kept as it is
url       the page and anchor of the built site, ``"book/09-decoding.html#sec-09-04"``
========  ====================================================================================

Code cells (and their outputs) are not part of the corpus: the corpus is the book's prose.

A pip-installed ``llmbook`` has no ``book/`` folder, so :func:`load_corpus` reads a snapshot shipped in
the package, ``llmbook/data/book_corpus.jsonl`` (one JSON object per passage, in corpus order).
:func:`build_corpus` regenerates the passages from a checkout and ``python -m llmbook corpus`` rewrites
the snapshot; ``tests/rag/test_corpus.py`` fails while the two differ.

The **queries** (``llmbook/data/rag_queries.tsv``, read by :func:`load_queries`) are questions a reader
of chapters 1-19 would ask, each with graded judgements by section: 2 = the section answers it, 1 = it
is related (a block without a target is named by its ``page#anchor``). A passage is relevant to a
query with the grade of its section (:func:`qrels`).
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from llmbook.chapters import CHAPTERS

__all__ = ["MIN_CHARS", "Passage", "Query", "anchor_slug", "build_corpus", "load_corpus", "load_queries",
           "notebook_passages", "passage_text", "plain_text", "qrels", "write_corpus"]

#: A cell piece shorter than this (in characters of plain text) joins the passage before it, in the same block.
MIN_CHARS = 200
SNAPSHOT = "book_corpus.jsonl"
QUERIES = "rag_queries.tsv"

_TARGET = re.compile(r"^\(([A-Za-z][\w.-]*)\)=\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_ROLE = re.compile(r"\{([\w:]+)\}`([^`]*)`")
_MATH_OR_CODE = re.compile(r"(\$\$.*?\$\$|\$[^$\n]+\$|`[^`\n]*`)", re.S)


@dataclass(frozen=True)
class Passage:
    """One passage of the book's prose (see the module docstring for the fields)."""

    id: str
    chapter: int
    section: str | None
    heading: str
    text: str
    url: str

    @property
    def full_text(self) -> str:
        """Heading and text, the string a retriever should index."""
        return f"{self.heading}\n\n{self.text}"


@dataclass(frozen=True)
class Query:
    """A labelled question: ``relevance`` maps section ids to grades (2 answers it, 1 is related)."""

    id: str
    text: str
    kind: str  # "plain", "paraphrase" (few words of the answer) or "exact" (a rare term or number)
    relevance: dict[str, int]
    #: ``"dev"`` (settings may be chosen on it) or ``"test"`` (reported only); ``""`` for an ad-hoc query.
    split: str = ""
    #: Sections an assessor read and judged not relevant (grade 0); with ``relevance``, the judged sections.
    nonrelevant: frozenset[str] = frozenset()

    @property
    def judged(self) -> frozenset[str]:
        """Every section judged for this query, at any grade (0, 1 or 2)."""
        return frozenset(self.relevance) | self.nonrelevant


def anchor_slug(heading: str) -> str:
    """The web anchor Sphinx gives an untargeted heading (docutils ``make_id``).

    >>> anchor_slug("9. Sampling and decoding")
    'sampling-and-decoding'
    >>> anchor_slug("Claims of this chapter")
    'claims-of-this-chapter'
    """
    s = unicodedata.normalize("NFKD", heading.lower()).encode("ascii", "ignore").decode("ascii")
    s = re.sub(r"[^a-z0-9]+", "-", " ".join(s.split()))
    return re.sub(r"^[-0-9]+|-+$", "", s)


def _role(m: re.Match) -> str:
    role, body = m.group(1), m.group(2).strip()
    if role == "cite":
        return "[" + ", ".join(k.strip() for k in body.split(",")) + "]"
    labelled = re.fullmatch(r"(.*?)\s*<([^>]+)>", body, re.S)
    if labelled:
        return " ".join(labelled.group(1).split())
    if role == "eq":
        return f"({body})"
    return body.split(".")[-1] if body.startswith("~") else body


def _prose(s: str) -> str:
    """Markdown markup removed from prose that holds no maths or code."""
    s = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", s)  # links and images keep their text
    s = re.sub(r"\*\*(.+?)\*\*", r"\1", s, flags=re.S)
    return re.sub(r"(?<![\w*])\*(?=\S)(.+?)(?<=\S)\*(?![\w*])", r"\1", s, flags=re.S)


def plain_text(markdown: str) -> str:
    """Plain text of a markdown fragment (LaTeX kept as it is; see the module docstring).

    >>> plain_text("(sec-09-02)=\\n**Top-k** {cite}`fan2018,holtzman2020` keeps $p_i^*$; see `top_k`.")
    'Top-k [fan2018, holtzman2020] keeps $p_i^*$; see top_k.'
    >>> DD = "$" * 2  # display maths (spelled so that the API page does not try to render it)
    >>> plain_text(f"{DD}\\nx = 1\\n{DD} (eq-x)\\n\\n| a | b |\\n|---|---|\\n| 1 | 2 |").replace(DD, "DD")
    'DD\\nx = 1\\nDD\\n\\na | b\\n1 | 2'
    """
    if not isinstance(markdown, str):
        raise TypeError(f"markdown must be a str, got {type(markdown).__name__}")
    lines, in_fence = [], False
    for line in re.sub(r"<!--.*?-->", "", markdown, flags=re.S).split("\n"):
        stripped = line.strip()
        if _TARGET.match(stripped) or re.fullmatch(r"\|?[\s:|-]*-{3,}[\s:|-]*", stripped or "x"):
            continue
        fence = re.match(r"^(`{3,}|:{3,})\s*(\{[\w-]+\})?\s*(.*)$", stripped)
        if fence:
            in_fence = not in_fence if not fence.group(2) else True
            if fence.group(2) and fence.group(3):
                lines.append(fence.group(3) + ":")  # ```{admonition} Solution -> "Solution:"
            continue
        if in_fence and re.match(r"^:[\w-]+:", stripped):
            continue  # directive options (:class: dropdown)
        heading = not in_fence and _HEADING.match(line)
        if heading:
            line = heading.group(2)
        if stripped.startswith("|"):
            line = " | ".join(c.strip() for c in stripped.strip("|").split("|"))
        lines.append(line.rstrip())
    s = "\n".join(lines)
    s = re.sub(r"\$\$\s*\((eq-[\w-]+)\)", "$$", s)
    s = _ROLE.sub(_role, s)
    parts = _MATH_OR_CODE.split(s)  # odd indices are maths or inline code, left untouched
    s = "".join(p if i % 2 else _prose(p) for i, p in enumerate(parts))
    s = re.sub(r"(?<!`)`([^`\n]+)`(?!`)", r"\1", s)
    return re.sub(r"\n{3,}", "\n\n", s).strip()


def notebook_passages(path: str | Path, chapter: int) -> list[Passage]:
    """The passages of one chapter notebook, in page order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"chapter {chapter}'s notebook {path} does not exist")
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    except (ValueError, KeyError) as err:
        raise ValueError(f"{path} is not a notebook (JSON with a 'cells' list): {err}") from err
    stem, passages, used = path.stem, [], {}
    block: dict = {"anchor": "", "section": None, "heading": "", "open": False, "count": 0}
    piece: list[str] = []

    def flush() -> None:
        text = plain_text("\n".join(piece))
        piece.clear()
        if not text:
            return
        if block["count"] and len(text) < MIN_CHARS:
            last = passages[-1]
            passages[-1] = Passage(**{**asdict(last), "text": f"{last.text}\n\n{text}"})
            return
        anchor = block["anchor"]
        k = used.get(anchor, 0)
        used[anchor] = k + 1
        block["count"] += 1
        url = f"book/{stem}.html" + (f"#{anchor}" if anchor else "")
        passages.append(Passage(f"{stem}#{anchor}/{k}", chapter, block["section"],
                                block["heading"] or block["section"] or stem, text, url))

    def start(anchor: str, section: str | None, heading: str, open_: bool) -> None:
        flush()
        block.update(anchor=anchor, section=section, heading=heading, open=open_, count=0)

    for cell in cells:
        if cell.get("cell_type") != "markdown":
            continue
        source = cell.get("source", "")
        fenced = False
        for line in ("".join(source) if isinstance(source, list) else source).split("\n"):
            fenced ^= line.lstrip().startswith(("```", ":::"))
            target, heading = _TARGET.match(line.strip()), not fenced and _HEADING.match(line)
            if target:
                start(target.group(1), target.group(1), "", True)
            elif heading and block["open"]:  # the heading that a target introduces
                block.update(heading=plain_text(heading.group(2)), open=False)
            elif heading and len(heading.group(1)) <= 2:
                title = plain_text(heading.group(2))
                start(anchor_slug(title), None, title, False)
            else:
                block["open"] = block["open"] and not line.strip()
                piece.append(line)
        flush()
    return passages


def build_corpus(root: str | Path = ".") -> list[Passage]:
    """Every written chapter's passages, from the notebooks of a checkout at ``root``, by chapter."""
    root = Path(root)
    if not (root / "book").is_dir():
        raise FileNotFoundError(f"{root.resolve()} has no book/ folder: build_corpus needs a checkout of llmbook "
                                "(a pip install ships only the snapshot that load_corpus() reads)")
    out: list[Passage] = []
    for ch in CHAPTERS.values():
        if ch.written:
            out.extend(notebook_passages(root / ch.notebook, ch.number))
    return out


def write_corpus(passages: list[Passage], path: str | Path) -> Path:
    """Write passages as JSON lines (the snapshot format); returns the path."""
    path = Path(path)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for p in passages:
            f.write(json.dumps(asdict(p), ensure_ascii=False, sort_keys=True) + "\n")
    return path


def _data_path(name: str, path: str | Path | None):
    return resources.files("llmbook.data").joinpath(name) if path is None else Path(path)


def load_corpus(path: str | Path | None = None) -> list[Passage]:
    """The passages of the shipped snapshot (or of the JSON-lines file ``path``), in corpus order.

    >>> corpus = load_corpus()
    >>> p = next(p for p in corpus if p.section == "sec-09-04")
    >>> p.id, p.chapter, p.url
    ('09-decoding#sec-09-04/0', 9, 'book/09-decoding.html#sec-09-04')
    """
    source = _data_path(SNAPSHOT, path)
    out = []
    for n, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        try:
            out.append(Passage(**json.loads(line)))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{source} line {n} is not a passage (JSON with the fields of Passage): {err}") from err
    return out


def load_queries(path: str | Path | None = None, split: str | None = None) -> list[Query]:
    """The labelled queries: TSV columns ``id, kind, split, query, relevant, nonrelevant``.

    ``relevant`` lists ``section:grade`` with grade 1 or 2 (``sec-03-01:2 sec-03-02:1``), ``nonrelevant`` the
    sections judged 0 (space-separated, may be empty). ``split`` (``"dev"`` or ``"test"``) keeps one half.

    >>> qs = load_queries()
    >>> all(g in (1, 2) for q in qs for g in q.relevance.values())
    True
    >>> halves = [load_queries(split=s) for s in ("dev", "test")]
    >>> {q.split for q in qs} == {"dev", "test"} and sum(map(len, halves)) == len(qs)
    True
    """
    if split not in (None, "dev", "test"):
        raise ValueError(f"split must be None, 'dev' or 'test', got {split!r}")
    source = _data_path(QUERIES, path)
    out, seen = [], set()
    for n, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        cols = line.split("\t")
        if len(cols) != 6:
            raise ValueError(f"{source} line {n}: expected 6 tab-separated columns (id, kind, split, query, "
                             f"relevant, nonrelevant), got {len(cols)}")
        qid, kind, part, text, rel, nonrel = (c.strip() for c in cols)
        if qid == "id":
            continue  # the header row
        relevance = {}
        for item in rel.split():
            section, _, grade = item.rpartition(":")
            if not section or grade not in ("1", "2"):
                raise ValueError(f"{source} line {n}: judgement {item!r} is not 'section:grade' with grade 1 or 2")
            relevance[section] = int(grade)
        zero = frozenset(nonrel.split())
        if qid in seen or kind not in ("plain", "paraphrase", "exact") or 2 not in relevance.values():
            raise ValueError(f"{source} line {n}: query {qid!r} needs a new id, a kind in plain/paraphrase/exact "
                             "and at least one section of grade 2")
        if part not in ("dev", "test"):
            raise ValueError(f"{source} line {n}: split must be 'dev' or 'test', got {part!r}")
        if zero & set(relevance):
            both = sorted(zero & set(relevance))
            raise ValueError(f"{source} line {n}: sections judged both relevant and not: {both}")
        seen.add(qid)
        if split is None or part == split:
            out.append(Query(qid, text, kind, relevance, part, zero))
    return out


def qrels(queries: list[Query], passages: list[Passage]) -> dict[str, dict[str, int]]:
    """Passage-level judgements: ``{query id: {passage id: grade}}``, a passage taking its section's grade.

    >>> q = Query("q", "why top-p?", "plain", {"sec-09-04": 2})
    >>> judged = qrels([q], load_corpus())["q"]
    >>> next(iter(judged)), set(judged.values())
    ('09-decoding#sec-09-04/0', {2})
    """
    by_section: dict[str, list[str]] = {}
    for p in passages:  # an untargeted block ("Try it") is judged by its page#anchor, "09-decoding#try-it"
        by_section.setdefault(p.section or p.id.rpartition("/")[0], []).append(p.id)
    out = {}
    for q in queries:
        missing = sorted(set(q.relevance) - set(by_section))
        if missing:
            raise ValueError(f"query {q.id!r} judges sections that have no passage in the corpus: {missing}")
        out[q.id] = {pid: g for s, g in q.relevance.items() for pid in by_section[s]}
    return out


def passage_text(passage) -> str:
    """The text of a passage that every retriever of Part II indexes: its heading, a full stop, its text.

    >>> passage_text(load_corpus()[0]).startswith(load_corpus()[0].heading)
    True
    """
    return f"{passage.heading}. {passage.text}" if passage.heading else passage.text
