"""The book's notebooks as stored: clean outputs that the site can render as they are."""

import json
import re
from pathlib import Path

import pytest

from llmbook.coverage import book_notebooks

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = book_notebooks(ROOT)
# a progress bar ("12/48 [00:01<00:03, 3.07it/s]") or a timing ("in 1.3 s", "12.5 ms", "0:00:03")
VOLATILE = re.compile(r"\d+(?:\.\d+)?\s?(?:it/s|s/it)|\[\d\d:\d\d<|\b\d+(?:\.\d+)?\s?(?:ms|µs|us|ns)\b"
                      r"|\bin \d+(?:\.\d+)? ?s\b|\b\d+:\d\d:\d\d\b")


def _outputs(nb: Path):
    for i, cell in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
        for out in cell.get("outputs", []):
            yield i, out


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_have_no_stderr_progress_bars_or_timings(nb):
    for i, out in _outputs(nb):
        assert not (out["output_type"] == "stream" and out["name"] == "stderr"), \
            f"{nb.name} cell {i} stores stderr: {''.join(out['text'])[:120]!r} (run `make notebooks`)"
        text = "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
        m = VOLATILE.search(text)
        assert not m, f"{nb.name} cell {i} stores a timing or progress bar: {m.group(0)!r}"
        assert out["output_type"] != "error", f"{nb.name} cell {i} stores an error"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_streams_are_merged(nb):
    """Consecutive prints of a cell are one stored block (``bookpages.coalesce_streams``): how a kernel
    splits them into messages depends on the machine's load, so split blocks would not be reproducible."""
    previous = None
    for i, out in _outputs(nb):
        here = (i, out.get("name")) if out["output_type"] == "stream" else None
        assert here is None or here != previous, \
            f"{nb.name} cell {i} stores its {out['name']} in several blocks (run `make notebooks`)"
        previous = here


def test_the_volatile_pattern_catches_what_it_should():
    for text in ["precomputing:  2%|▏ | 1/48 [00:00<00:15,  3.07it/s]", "executed in 1.3 s", "took 12.5 ms",
                 "0:00:03 elapsed"]:
        assert VOLATILE.search(text), text
    for text in ["max abs diff 3e-07", "T = 512: ratio 0.91", "d_k = 64 s.t. Var = 64", "L = 3 layers"]:
        assert not VOLATILE.search(text), text


def test_attribute_doc_comments_have_no_colon_that_napoleon_reads_as_a_type():
    """Sphinx's napoleon reads ``#: words: more`` on a module constant as ``type: description`` and the
    book build (-n -W) then fails on a missing class named "words"; write such comments without a colon."""
    import re

    offenders = []
    for path in sorted((ROOT / "llmbook").rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            starts = line.startswith("#: ") and not (i and lines[i - 1].startswith("#: "))
            # napoleon splits at the first single colon outside roles and ``literals`` (even "2:4")
            text = re.sub(r"(:\w+:)?`[^`]*`|``[^`]*``", "", line[3:])
            if starts and re.search(r"(?<!:):(?!:)", text):
                offenders.append(f"{path.relative_to(ROOT)}:{i + 1}: {line}")
    assert not offenders, "\n".join(offenders)


# import name -> distribution name, where they differ
_DISTRIBUTION = {"sklearn": "scikit-learn", "lion_pytorch": "lion-pytorch", "rouge_score": "rouge-score",
                 "mauve": "mauve-text",
                 "rank_bm25": "rank-bm25", "faiss": "faiss-cpu", "pytrec_eval": "pytrec-eval-terrier"}
_INSTALLED_WITH_LLMBOOK = {"llmbook", "torch", "numpy", "matplotlib", "ipywidgets", "tqdm", "jaxtyping", "IPython"}


def test_the_book_extra_installs_every_package_a_notebook_imports():
    """On Colab the set-up cell installs ``llmbook[book]``: a chapter that imports a package missing from
    that extra would fail there at its imports cell, though it passes here."""
    import sys

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    listed = {re.split(r"[<>=!~ \[;]", spec, maxsplit=1)[0].lower() for spec in extra["book"]}
    missing = []
    for nb in NOTEBOOKS:
        for cell in json.loads(nb.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "code":
                continue
            for name in re.findall(r"^\s*(?:from|import)\s+(\w+)", "".join(cell["source"]), re.M):
                if name in sys.stdlib_module_names or name in _INSTALLED_WITH_LLMBOOK:
                    continue
                if _DISTRIBUTION.get(name, name).lower() not in listed:
                    missing.append(f"{nb.name} imports {name}")
    assert not missing, ("add to [project.optional-dependencies] book in pyproject.toml: "
                         + "; ".join(sorted(set(missing))))
