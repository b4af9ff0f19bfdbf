r"""Can every ✓ of the book fail? An audit that perturbs each implementation and re-runs its section's checks.

A printed check (:func:`llmbook.verify.check_close`, :func:`~llmbook.verify.check_claim`) is evidence only if a
wrong implementation would break it. The audit makes each registered implementation wrong on purpose, by a
relative :math:`10^{-3}` on every floating-point number it returns (:func:`perturbed`: tensors, arrays and
floats, inside tuples, lists, dicts and dataclasses; for an ``nn.Module`` class, the output of ``forward``),
and re-runs the section of its chapter that shows it (the cells from the markdown label ``(sec-CC-NN)=`` to the
next section) with the checks recording their verdicts instead of raising. Then it runs the section again
unperturbed, so that the rest of the notebook sees the state it expects.

For each equation the report gives how often the perturbed object was called in its section, and every
check of the section with its verdict under the perturbation:

* **caught**: the check failed, as it should;
* **survived**: the check still passed. Either it does not test this implementation (it tests a neighbour,
  or a property that a scale of :math:`1 + 10^{-3}` keeps, such as an argmax or a ratio), or its tolerance is
  looser than :math:`10^{-3}` relative, or it compares the implementation with itself.

``python -m llmbook audit-checks [CC ...]`` runs it (every chapter by default) and writes the report. A
section whose implementation is never called, or returns no floating-point number (token ids, booleans),
cannot be audited this way, and the report says so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from llmbook import registry, verify

__all__ = ["audit_notebook", "perturbed", "scaled"]

FACTOR = 1.0 + 1e-3
MARK = "LLMBOOK-AUDIT "
SECTION = re.compile(r"\(sec-(\d\d)-(\d\d)\)=")


def scaled(value, factor: float = FACTOR):
    """``value`` with every floating-point number multiplied by ``factor``; other values unchanged.

    >>> scaled((torch.tensor([1.0, 2.0]), 3, 0.5), 2.0)
    (tensor([2., 4.]), 3, 1.0)
    """
    if isinstance(value, torch.Tensor):
        return value * factor if value.is_floating_point() or value.is_complex() else value
    if isinstance(value, np.ndarray):
        return value * factor if np.issubdtype(value.dtype, np.inexact) else value
    if isinstance(value, (float, np.floating)):
        return type(value)(value * factor)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(scaled(v, factor) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(scaled(v, factor) for v in value)
    if isinstance(value, dict):
        return {k: scaled(v, factor) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: scaled(getattr(value, f.name), factor)
                                             for f in dataclasses.fields(value) if f.init})
    return value


@contextmanager
def perturbed(obj, namespaces=(), factor: float = FACTOR):
    """Within the block, ``obj`` (a function, or an ``nn.Module`` class) returns :func:`scaled` outputs.

    A function is replaced wherever a module of ``llmbook`` (or a dict of ``namespaces``, such as a kernel's
    globals) holds it, so callers inside the library see the perturbed version too. Yields a dict whose
    ``"calls"`` counts the calls made in the block.
    """
    stats = {"calls": 0}
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        original = obj.__dict__.get("forward", None)
        base_forward = obj.forward

        def forward(self, *args, **kwargs):
            stats["calls"] += 1
            return scaled(base_forward(self, *args, **kwargs), factor)

        obj.forward = forward
        try:
            yield stats
        finally:
            if original is None:
                del obj.forward
            else:
                obj.forward = original
        return
    if isinstance(obj, type) or not callable(obj):
        stats["skipped"] = f"{type(obj).__name__} {getattr(obj, '__name__', obj)!r} is not a function or a module class"
        yield stats
        return

    @functools.wraps(obj)
    def wrapper(*args, **kwargs):
        stats["calls"] += 1
        return scaled(obj(*args, **kwargs), factor)

    places = [vars(m) for name, m in list(sys.modules.items()) if name.startswith("llmbook") and m is not None]
    places += list(namespaces)
    patched = []
    for ns in places:
        for key, value in list(ns.items()):
            if value is obj:
                ns[key] = wrapper
                patched.append((ns, key))
    try:
        yield stats
    finally:
        for ns, key in patched:
            ns[key] = obj


_STATE: dict = {}


def begin(eq_id: str, namespace: dict) -> None:
    """Start auditing ``eq_id`` in a kernel: perturb its implementation and record the checks (internal)."""
    obj = registry.resolve(registry.implementation(eq_id))
    ctx = perturbed(obj, namespaces=(namespace,))
    _STATE.update(eq_id=eq_id, ctx=ctx, stats=ctx.__enter__(), name=registry.implementation(eq_id))
    verify.AUDIT_RECORD = []


def end() -> None:
    """Stop auditing; print the section's record as one marked JSON line (internal)."""
    _STATE["ctx"].__exit__(None, None, None)
    record = {"id": _STATE["eq_id"], "object": _STATE["name"], "calls": _STATE["stats"]["calls"],
              "skipped": _STATE["stats"].get("skipped"), "checks": verify.AUDIT_RECORD}
    verify.AUDIT_RECORD = None
    print(MARK + json.dumps(record))


def _sections(cells) -> list[tuple[str | None, list[int]]]:
    """Consecutive runs of cell indices, each with the registered equation id its section shows (or None)."""
    implemented = set(registry.implementations())
    out: list[tuple[str | None, list[int]]] = [(None, [])]
    for i, cell in enumerate(cells):
        if cell.cell_type == "markdown":
            m = SECTION.search(cell.source)
            heading = re.search(r"^#{1,2} ", cell.source, re.MULTILINE)
            if m or heading:
                eq_id = f"{m.group(1)}.{m.group(2)}" if m else None
                out.append((eq_id if eq_id in implemented else None, []))
        out[-1][1].append(i)
    return [s for s in out if s[1]]


def audit_notebook(path: str | Path, timeout: int = 900) -> list[dict]:
    """Audit one chapter notebook (see the module docstring); returns one record per audited section."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    scratch = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("")])  # nbclient stores each run cell here
    client = NotebookClient(scratch, timeout=timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    records = []

    def run(source: str) -> list:
        cell = nbformat.v4.new_code_cell(source)
        client.execute_cell(cell, 0)
        return cell.outputs

    with client.setup_kernel():
        run("import llmbook.audit as _llmbook_audit")
        for eq_id, idx in _sections(nb.cells):
            code = [i for i in idx if nb.cells[i].cell_type == "code"]
            if eq_id is not None and code:
                run(f"_llmbook_audit.begin({eq_id!r}, globals())")
                errors = 0
                for i in code:
                    cell = nbformat.v4.new_code_cell(nb.cells[i].source)
                    client.execute_cell(cell, 0)
                    errors += sum(o.get("output_type") == "error" for o in cell.outputs)
                outputs = run("_llmbook_audit.end()")
                text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
                line = next(ln for ln in text.splitlines() if ln.startswith(MARK))
                record = json.loads(line[len(MARK):])
                record["errors"] = errors
                records.append(record)
            for i in code:  # the section as written, so that later sections see the state they expect
                cell = nbformat.v4.new_code_cell(nb.cells[i].source)
                client.execute_cell(cell, 0)
                failed = [o for o in cell.outputs if o.get("output_type") == "error"]
                if failed and eq_id is not None:  # a cell that changes its own inputs cannot run twice
                    records[-1]["rerun_error"] = f"cell {i}: {failed[0].get('ename')}"
                elif failed:
                    raise RuntimeError(f"{path.name}, cell {i} fails without any perturbation: "
                                       f"{failed[0].get('ename')}: {failed[0].get('evalue')}")
    return records


def report(results: dict[str, list[dict]]) -> str:
    """The audit's Markdown report: a summary line per chapter and every surviving check."""
    lines = ["# Which checks can fail: the perturbation audit", "",
             f"Each registered implementation's outputs were multiplied by {FACTOR:g} and its section re-run "
             "(`python -m llmbook audit-checks`, `llmbook/audit.py`). *Caught*: checks of the section that failed, "
             "as they should. *Survived*: checks that still passed. *Not called*: the section never called the "
             "perturbed object, so its checks test something else.", ""]
    totals = {"caught": 0, "survived": 0, "sections": 0, "not called": 0}
    body = []
    for nb, records in results.items():
        caught = sum(not ok for r in records for _, ok in r["checks"])
        survived = [(r, what) for r in records for what, ok in r["checks"] if ok]
        idle = [r for r in records if r["calls"] == 0]
        totals["caught"] += caught
        totals["survived"] += len(survived)
        totals["sections"] += len(records)
        totals["not called"] += len(idle)
        body.append(f"## {nb}: {len(records)} sections, {caught} checks caught, {len(survived)} survived, "
                    f"{len(idle)} sections not calling their implementation")
        body.append("")
        body.append("| eq | object | calls | caught | survived (still ✓ under the perturbation) |")
        body.append("|---|---|---|---|---|")
        for r in records:
            kept = [w for w, ok in r["checks"] if ok]
            note = r.get("skipped") or ""
            if r.get("rerun_error"):
                note = (note + "; " if note else "") + f"the section fails when run a second time ({r['rerun_error']})"
            body.append(f"| {r['id']} | `{r['object'].split(':')[1]}` | {r['calls']} | "
                        f"{sum(not ok for _, ok in r['checks'])} | "
                        + ("; ".join(w.replace("|", "/") for w in kept) or "none") + (f" ({note})" if note else "")
                        + " |")
        body.append("")
    lines.append(f"**Total**: {totals['sections']} sections audited; {totals['caught']} checks caught the "
                 f"perturbation, {totals['survived']} survived; {totals['not called']} sections never called "
                 "their implementation.")
    lines.append("")
    return "\n".join(lines + body)


def main(chapters: list[int] | None = None, out: str | Path | None = None) -> int:
    """Audit the chapters (all by default), print a line per chapter and write the Markdown report to ``out``."""
    nbs = sorted(p for p in Path("book").glob("[0-9][0-9]-*.ipynb") if chapters is None or int(p.name[:2]) in chapters)
    results = {}
    for nb in nbs:
        start = time.perf_counter()
        results[nb.stem] = records = audit_notebook(nb)
        survived = sum(ok for r in records for _, ok in r["checks"])
        print(f"{nb.stem}: {len(records)} sections, {survived} checks survived ({time.perf_counter() - start:.0f} s)")
    text = report(results)
    if out is not None:
        Path(out).write_text(text, encoding="utf-8")
        print(f"wrote {out}")
    return 0
