r"""Can every ✓ of the book fail? An audit that perturbs each implementation and re-runs its section's checks.

A printed check (:func:`llmbook.verify.check_close`, :func:`~llmbook.verify.check_claim`) is evidence only if a
wrong implementation would break it. The audit makes each registered implementation wrong on purpose, by a
relative :math:`10^{-3}` on every floating-point number it returns (:func:`perturbed`: tensors, arrays and
floats, inside tuples, lists, dicts and dataclasses; for an ``nn.Module`` class, the output of ``forward``),
and re-runs the section of its chapter that shows it (the cells from the markdown label ``(sec-CC-NN)=`` to the
next section) with the checks recording their verdicts instead of raising. Then it runs the section again
unperturbed, so that the rest of the notebook sees the state it expects.

An integer a registered implementation returns (a FLOP or byte count, a capacity) moves by
:math:`\max(1, \mathrm{round}(10^{-3}|n|))`; a sequence of ids or a mask (an integer or bool tensor, a list of
ints) gets one wrong entry, and a list of pieces (strings) two swapped (:func:`scaled`).

A check that passes under its own section's perturbation may test another object of the library (a
neighbour, a helper that is not registered). So each section with such a check is run once more with
*every* public function, method and ``nn.Module`` class of the library perturbed at once (:func:`perturbed_library`;
the checks, validation, plotting and the book's machinery excepted). For each equation the report gives how
often the perturbed object was called in its section, and every check of the section with its verdict:

* **caught**: the check failed under the perturbation of its section's implementation, as it should;
* **caught by the library pass**: it failed only when the whole library was perturbed, so it tests another
  library object, and a wrong one would break it;
* **raised**: the library pass stopped the section with an error before the check ran (the notebook fails,
  but not through this check);
* **survived**: the check passed both times, so no number the library computes can make it fail: it
  compares the library with itself, or tests a property that a scale of :math:`1 + 10^{-3}` keeps (an
  argmax, a ratio, an order), or its tolerance is looser than :math:`10^{-3}` relative.

``python -m llmbook audit-checks [CC ...]`` runs it (every chapter by default) and writes the report. A
section whose implementation is never called, or returns no floating-point number (token ids, booleans),
cannot be audited this way, and the report says so.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
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
from llmbook.audit_report import FACTOR, _raised, _survivors, report  # noqa: F401 (the report lives there)

__all__ = ["audit_notebook", "perturbed", "perturbed_library", "scaled"]

MARK = "LLMBOOK-AUDIT "
SECTION = re.compile(r"\(sec-(\d\d)-(\d\d)\)=")


def scaled(value, factor: float = FACTOR, ints: bool = False, int_tensors: bool | None = None):
    """``value`` with every floating-point number multiplied by ``factor``; other values unchanged.

    With ``ints``, a Python or NumPy integer (not a bool) also moves, by ``max(1, round(|n| (factor - 1)))``,
    so that a counting function (FLOPs, bytes, a capacity) is perturbed too; and an integer or bool tensor
    (token ids, indices, a mask) gets one wrong entry: its first element moves down by 1 (up from 0), or
    flips, which keeps an id inside its vocabulary (``int_tensors=False`` leaves tensors alone; by default
    it follows ``ints``).

    >>> scaled((torch.tensor([1.0, 2.0]), 3, 0.5), 2.0)
    (tensor([2., 4.]), 3, 1.0)
    >>> scaled((3, True, 4000, torch.tensor([0, 5]), torch.tensor([True])), 1.001, ints=True)
    (4, True, 4004, tensor([1, 5]), tensor([False]))

    A plain list or tuple of ids gets the same one wrong entry, and a list of strings (a tokenizer's pieces)
    has its first two swapped, so that every lookup still works:

    >>> scaled(([7, 8, 9], ["un", "##able"]), 1.001, ints=True)
    ([6, 8, 9], ['##able', 'un'])
    """
    if ints and isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return type(value)(value + max(1, round(abs(int(value)) * (factor - 1))))
    int_tensors = ints if int_tensors is None else int_tensors
    if int_tensors and isinstance(value, torch.Tensor) and value.numel() and not (value.is_floating_point()
                                                                           or value.is_complex()):
        out = value.clone()
        flat = out.view(-1) if out.is_contiguous() else out.reshape(-1)
        if out.dtype == torch.bool:
            flat[0] = ~flat[0]
        else:
            flat[0] = flat[0] - 1 if flat[0] > 0 else flat[0] + 1
        return out if out.is_contiguous() else flat.reshape(value.shape)
    if isinstance(value, torch.Tensor):
        return value * factor if value.is_floating_point() or value.is_complex() else value
    if isinstance(value, np.ndarray):
        return value * factor if np.issubdtype(value.dtype, np.inexact) else value
    if isinstance(value, (float, np.floating)):
        return type(value)(value * factor)
    if ints and type(value) in (list, tuple) and len(value) >= 2 and all(isinstance(v, str) for v in value):
        if value[0] != value[1]:  # a sequence of pieces: the first two swap places
            return type(value)([value[1], value[0], *value[2:]])
        return value
    if ints and type(value) in (list, tuple) and value and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in value):
        first = int(value[0])  # a sequence of ids: one wrong entry, as for an integer tensor
        return type(value)([type(value[0])(first - 1 if first > 0 else first + 1), *value[1:]])
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(scaled(v, factor, ints, int_tensors) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(scaled(v, factor, ints, int_tensors) for v in value)
    if isinstance(value, dict):  # a subclass keeps its type and attributes (only its items are scaled)
        out = copy.copy(value) if type(value) is not dict else {}
        out.update({k: scaled(v, factor, ints, int_tensors) for k, v in value.items()})
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: scaled(getattr(value, f.name), factor, ints, int_tensors)
                                             for f in dataclasses.fields(value) if f.init})
    return value


@contextmanager
def perturbed(obj, namespaces=(), factor: float = FACTOR, ints: bool = False, int_tensors: bool | None = None):
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
            return scaled(base_forward(self, *args, **kwargs), factor, ints, int_tensors)

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
        return scaled(obj(*args, **kwargs), factor, ints, int_tensors)

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


#: Modules the library-wide pass leaves alone (the checks themselves, input validation, plotting, the
#: book's machinery and widgets, which display and compute nothing a check tests).
INFRASTRUCTURE = ("llmbook.verify", "llmbook.audit", "llmbook._checks", "llmbook.plotting", "llmbook.registry",
                  "llmbook.coverage", "llmbook.chapters", "llmbook.cli", "llmbook.bookpages", "llmbook.links",
                  "llmbook.freshness", "llmbook.cpu", "llmbook._precision", "llmbook.widgets", "llmbook.__main__",
                  "llmbook.data")


def _library_methods() -> list[tuple[type, str]]:
    """``(class, name)`` of every public plain method of the classes (not ``nn.Module``) of the library."""
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("llmbook") or name.startswith(INFRASTRUCTURE):
            continue
        for value in vars(module).values():
            if (isinstance(value, type) and getattr(value, "__module__", None) == name
                    and not issubclass(value, (nn.Module, BaseException))):
                for key, attr in vars(value).items():
                    if not key.startswith("_") and inspect.isfunction(attr):
                        found[(id(value), key)] = (value, key)
    return list(found.values())


@contextmanager
def _perturbed_method(cls: type, name: str, factor: float = FACTOR, ints: bool = True, int_tensors: bool = False):
    """Within the block, ``cls.name`` returns :func:`scaled` outputs."""
    original = vars(cls)[name]

    @functools.wraps(original)
    def method(*args, **kwargs):
        return scaled(original(*args, **kwargs), factor, ints, int_tensors)

    setattr(cls, name, method)
    try:
        yield
    finally:
        setattr(cls, name, original)


def _library_objects() -> list:
    """Every public function and ``nn.Module`` class defined in a non-infrastructure module of ``llmbook``."""
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("llmbook") or name.startswith(INFRASTRUCTURE):
            continue
        for key, value in vars(module).items():
            if key.startswith("_") or getattr(value, "__module__", None) != name:
                continue
            if isinstance(value, type) and issubclass(value, nn.Module) and "forward" in vars(value):
                found[id(value)] = value
            elif callable(value) and not isinstance(value, type) and hasattr(value, "__code__"):
                found[id(value)] = value
    return list(found.values())


@contextmanager
def perturbed_library(namespaces=(), factor: float = FACTOR):
    """Within the block, every object of ``_library_objects()`` and every method of ``_library_methods()``
    returns :func:`scaled` outputs (floats and
    integers; not integer tensors, whose one wrong entry would send ids out of range all through the library).

    A check that still passes then depends on no number the library computed: it compares the library with
    itself, or tests a property that a uniform scale keeps, or is looser than the scale. Yields a dict whose
    ``"objects"`` counts the objects patched.
    """
    from contextlib import ExitStack

    with ExitStack() as stack:
        objects = _library_objects()
        for obj in objects:
            stack.enter_context(perturbed(obj, namespaces=namespaces, factor=factor, ints=True, int_tensors=False))
        methods = _library_methods()
        for cls, name in methods:
            stack.enter_context(_perturbed_method(cls, name, factor))
        yield {"objects": len(objects) + len(methods)}


_STATE: dict = {}


def begin(eq_id: str, namespace: dict, library: bool = False) -> None:
    """Start auditing ``eq_id`` in a kernel: perturb its implementation (or, with ``library``, every library
    object) and record the checks (internal)."""
    obj = registry.resolve(registry.implementation(eq_id))
    ctx = perturbed_library(namespaces=(namespace,)) if library else perturbed(obj, namespaces=(namespace,), ints=True)
    _STATE.update(eq_id=eq_id, ctx=ctx, stats=ctx.__enter__(), name=registry.implementation(eq_id))
    verify.AUDIT_RECORD = []


def end() -> None:
    """Stop auditing; print the section's record as one marked JSON line (internal)."""
    _STATE["ctx"].__exit__(None, None, None)
    record = {"id": _STATE["eq_id"], "object": _STATE["name"], "calls": _STATE["stats"].get("calls"),
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


def watch() -> None:
    """Record the checks of an unperturbed run (internal)."""
    verify.AUDIT_RECORD = []


def watched() -> None:
    """Print the checks recorded since :func:`watch` as one marked JSON line, and stop recording (internal)."""
    record = {"checks": verify.AUDIT_RECORD}
    verify.AUDIT_RECORD = None
    print(MARK + json.dumps(record))


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

    def marked(outputs) -> dict:
        text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
        return json.loads(next(ln for ln in text.splitlines() if ln.startswith(MARK))[len(MARK):])

    def section(code: list[int], start: str, stop: str) -> tuple[dict, list]:
        run(start)
        failures = []
        for i in code:
            cell = nbformat.v4.new_code_cell(nb.cells[i].source)
            client.execute_cell(cell, 0)
            failures += [(i, o) for o in cell.outputs if o.get("output_type") == "error"]
        return marked(run(stop)), failures

    def plain(code: list[int], eq_id) -> list:
        """The section as written, so that later sections see the state they expect; returns its checks."""
        checks, failed = section(code, "_llmbook_audit.watch()", "_llmbook_audit.watched()")
        if failed and eq_id is not None:  # a cell that changes its own inputs cannot run twice
            records[-1]["rerun_error"] = f"cell {failed[0][0]}: {failed[0][1].get('ename')}"
        elif failed:
            i, out = failed[0]
            raise RuntimeError(f"{path.name}, cell {i} fails without any perturbation: "
                               f"{out.get('ename')}: {out.get('evalue')}")
        return checks["checks"]

    with client.setup_kernel():
        run("import llmbook.audit as _llmbook_audit")
        for eq_id, idx in _sections(nb.cells):
            code = [i for i in idx if nb.cells[i].cell_type == "code"]
            audited = eq_id is not None and bool(code)
            if audited:
                record, failed = section(code, f"_llmbook_audit.begin({eq_id!r}, globals())", "_llmbook_audit.end()")
                record["errors"] = len(failed)
                records.append(record)
            checks = plain(code, eq_id)
            if audited:
                record["unperturbed"] = checks
                if any(ok for _, ok in record["checks"]):  # the library-wide pass, then the section again
                    lib, failed = section(code, f"_llmbook_audit.begin({eq_id!r}, globals(), library=True)",
                                          "_llmbook_audit.end()")
                    record["library"], record["library_errors"] = lib["checks"], len(failed)
                    record["library_error_names"] = [f"cell {i}: {o.get('ename')}: {o.get('evalue', '')[:80]}"
                                                     for i, o in failed]
                    plain(code, eq_id)
    return records


def main(chapters: list[int] | None = None, out: str | Path | None = None) -> int:
    """Audit the chapters (all by default), print a line per chapter and write the Markdown report to ``out``."""
    nbs = sorted(p for p in Path("book").glob("[0-9][0-9]-*.ipynb") if chapters is None or int(p.name[:2]) in chapters)
    results = {}
    for nb in nbs:
        start = time.perf_counter()
        results[nb.stem] = records = audit_notebook(nb)
        survived = sum(len(_survivors(r)) for r in records)
        print(f"{nb.stem}: {len(records)} sections, {survived} checks survived ({time.perf_counter() - start:.0f} s)")
    text = report(results)
    if out is not None:
        Path(out).write_text(text, encoding="utf-8")
        print(f"wrote {out}")
    return 0
