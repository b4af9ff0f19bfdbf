"""The perturbation audit (llmbook.audit): it scales outputs, patches and restores, and tells a check that can
fail from one that cannot, on a small notebook written here."""

import dataclasses
from collections import namedtuple

import nbformat
import numpy as np
import torch

from llmbook import audit
from llmbook.lm import norms, probability


def test_scaled_reaches_floats_inside_containers_and_leaves_the_rest():
    P = namedtuple("P", "a b")

    @dataclasses.dataclass
    class D:
        x: torch.Tensor
        n: int

    out = audit.scaled({"t": (torch.tensor([1.0]), torch.tensor([2])), "p": P(np.array([2.0]), True),
                        "d": D(torch.tensor([3.0]), 4), "f": 0.5}, 2.0)
    assert out["t"][0].item() == 2.0 and out["t"][1].dtype == torch.int64 and out["t"][1].item() == 2
    assert out["p"].a[0] == 4.0 and out["p"].b is True
    assert out["d"].x.item() == 6.0 and out["d"].n == 4 and out["f"] == 1.0


def test_perturbed_patches_the_library_and_a_namespace_then_restores():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    ns = {"softmax": probability.softmax}
    ref = probability.softmax(x)
    with audit.perturbed(probability.softmax, namespaces=(ns,), factor=2.0) as stats:
        assert torch.allclose(probability.softmax(x), 2 * ref) and torch.allclose(ns["softmax"](x), 2 * ref)
    assert stats["calls"] == 2
    assert torch.equal(probability.softmax(x), ref) and ns["softmax"] is probability.softmax
    layer = norms.RMSNorm(3)
    before = layer(x)
    with audit.perturbed(norms.RMSNorm, factor=2.0):
        assert torch.allclose(layer(x), 2 * before)
    assert torch.equal(layer(x), before) and "forward" in vars(norms.RMSNorm)


def test_audit_tells_a_check_that_can_fail_from_one_that_cannot(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import torch\nfrom llmbook.lm import probability as pr\n"
                                  "from llmbook.verify import check_close\nz = torch.tensor([1.0, 2.0, 3.0])"),
        nbformat.v4.new_markdown_cell("(sec-01-03)=\n## Softmax"),
        nbformat.v4.new_code_cell("check_close('torch.softmax', pr.softmax(z), torch.softmax(z, -1), atol=1e-6)\n"
                                  "check_close('itself', pr.softmax(z), pr.softmax(z), atol=0)\n"
                                  "check_close('a neighbour', pr.logsumexp(z), torch.logsumexp(z, -1), atol=1e-6)"),
        nbformat.v4.new_markdown_cell("## Elsewhere"),
        nbformat.v4.new_code_cell("check_close('torch.softmax again', pr.softmax(z), torch.softmax(z, -1))"),
    ]
    path = tmp_path / "01-toy.ipynb"
    nbformat.write(nb, path)
    (record,) = audit.audit_notebook(path)
    assert record["id"] == "01.03" and record["calls"] == 3 and record["errors"] == 0
    assert record["checks"] == [["matches torch.softmax", False], ["matches itself", True],
                                ["matches a neighbour", True]]
    # the library-wide pass breaks the neighbour's check but not the comparison of softmax with itself
    assert record["library"] == [["matches torch.softmax", False], ["matches itself", True],
                                 ["matches a neighbour", False]]
    assert record["unperturbed"] == [["matches torch.softmax", True], ["matches itself", True],
                                     ["matches a neighbour", True]]
    text = audit.report({"01-toy": [record]})
    assert "1 checks caught the perturbation of their section's implementation, 1 more were caught by the " \
           "library-wide pass, 0 were stopped by an error the library pass raised, 1 survived both" in text
    # a check that did not run because the library pass raised is counted apart from the survivors
    raised = dict(record, library=[["matches torch.softmax", False]], library_errors=1,
                  library_error_names=["cell 2: ValueError: x"])
    assert audit._survivors(raised) == [] and audit._raised(raised) == ["matches itself", "matches a neighbour"]
    assert "matches itself" in text and "matches a neighbour" not in text


def test_integers_move_only_when_asked():
    assert audit.scaled(7, 1.001) == 7 and audit.scaled(7, 1.001, ints=True) == 8
    assert audit.scaled(np.int64(10_000), 1.001, ints=True) == 10_010 and audit.scaled(False, 2.0, ints=True) is False
    ids = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(audit.scaled(ids, 1.001), ids)  # integer tensors move only with ints
    assert audit.scaled(ids, 1.001, ints=True).tolist() == [[0, 2], [3, 4]] and ids[0, 0] == 1
    assert audit.scaled(torch.tensor([0, 7]), 1.001, ints=True).tolist() == [1, 7]
    assert audit.scaled(torch.tensor([True, True]), 1.001, ints=True).tolist() == [False, True]
    assert audit.scaled(ids.t(), 1.001, ints=True).tolist() == [[0, 3], [2, 4]]  # not contiguous
