"""The perturbation audit's verdicts and its Markdown report (``python -m llmbook audit-checks``).

:mod:`llmbook.audit` runs each section under the perturbations and records every check's verdict; this module
sorts the checks that passed (caught by the library pass, raised, survived) and writes the report,
``book/check-audit.md``.
"""

from __future__ import annotations

#: The relative perturbation of every number an implementation returns (used by :mod:`llmbook.audit`).
FACTOR = 1.0 + 1e-3

__all__ = ["FACTOR", "report"]


def _survivors(record: dict) -> list[str]:
    """Checks of ``record`` that passed under its own perturbation and again under the library-wide one."""
    return _split_passed(record)[0]


def _raised(record: dict) -> list[str]:
    """Checks that passed under their own perturbation and did not run under the library-wide one, because a cell
    of the section raised first (the notebook fails: the perturbation is noticed, but not by this check)."""
    return _split_passed(record)[1]


def _split_passed(record: dict) -> tuple[list[str], list[str]]:
    library: dict[str, list[bool]] = {}
    for what, ok in record.get("library") or []:
        library.setdefault(what, []).append(ok)
    survived, raised = [], []
    for what, ok in record["checks"]:
        if not ok:
            continue
        if library.get(what):
            if library[what].pop(0):
                survived.append(what)
        elif record.get("library") is None or not record.get("library_errors"):
            survived.append(what)  # no library pass ran, or it ran cleanly without this check
        else:
            raised.append(what)
    return survived, raised


def report(results: dict[str, list[dict]]) -> str:
    """The audit's Markdown report: a summary line per chapter and every surviving check."""
    lines = ["# Which checks can fail: the perturbation audit", "",
             "This page is the report of the book's own audit of its checks, written by the command it names. "
             "A printed ✓ is evidence only if a wrong implementation would break it, so the audit breaks each "
             "implementation on purpose and counts the ✓ that still appear. Chapters that are not listed below "
             "were not audited in this run.", "",
             f"Each registered implementation's outputs were multiplied by {FACTOR:g} (integers moved by at least 1; "
             "an id sequence or a mask given one wrong entry; a list of pieces given two swapped) and its section "
             "re-run (`python -m llmbook audit-checks`, `llmbook/audit.py`). *Caught*: checks of the section that "
             "failed, as they should. A check that passed was run once more with every function, method and module "
             "of the library perturbed at once: *caught by the library pass* means it tests another library object "
             "than the section's own, and does fail when that is wrong. *Raised*: the library pass stopped the "
             "section with an error before the check ran, so the notebook fails, but this check is not what "
             "noticed. *Survived*: it passed both times, so no number the library computes can make it fail. "
             "*Not run*: checks of the unperturbed section that did not run under the section's own perturbation.",
             ""]
    keys = ("caught", "library", "raised", "survived", "sections", "not run")
    totals = dict.fromkeys(keys, 0)
    body = []
    for nb, records in results.items():
        n = dict.fromkeys(keys, 0)
        rows = []
        for r in records:
            kept, raised = _survivors(r), _raised(r)
            caught = sum(not ok for _, ok in r["checks"])
            library = sum(ok for _, ok in r["checks"]) - len(kept) - len(raised)
            missing = max(0, len(r.get("unperturbed", r["checks"])) - len(r["checks"]))
            n["caught"] += caught
            n["library"] += library
            n["raised"] += len(raised)
            n["survived"] += len(kept)
            n["not run"] += missing
            n["sections"] += 1
            notes = [r["skipped"]] if r.get("skipped") else []
            if missing:
                notes.append(f"{missing} not run under the perturbation")
            if raised:
                notes.append("raised in the library pass: " + ", ".join(r["library_error_names"]) + " (checks: "
                             + "; ".join(raised) + ")")
            if r.get("rerun_error"):
                notes.append(f"the section fails when run a second time ({r['rerun_error']})")
            rows.append(f"| {r['id']} | `{r['object'].split(':')[1]}` | {r['calls']} | {caught} | {library} | "
                        f"{len(raised)} | " + ("; ".join(kept) or "none").replace("|", "/")
                        + (f" ({'; '.join(notes)})".replace("|", "/") if notes else "") + " |")
        for k in keys:
            totals[k] += n[k]
        body += [f"## {nb}: {n['sections']} sections, {n['caught']} checks caught, {n['library']} caught by the "
                 f"library pass, {n['raised']} raised, {n['survived']} survived, {n['not run']} not run", "",
                 "| eq | object | calls | caught | caught by the library pass | raised | survived (✓ under both "
                 "perturbations) |", "|---|---|---|---|---|---|---|", *rows, ""]
    lines.append(f"**Total**: {totals['sections']} sections audited; {totals['caught']} checks caught the "
                 f"perturbation of their section's implementation, {totals['library']} more were caught by the "
                 f"library-wide pass, {totals['raised']} were stopped by an error the library pass raised, "
                 f"{totals['survived']} survived both; {totals['not run']} did not run under the section's own "
                 "perturbation.")
    lines.append("")
    return "\n".join(lines + body)
