"""Print CI's stage table, the slowest notebooks and a projection of the run to all 43 chapters.

Usage: python .ci/timings.py _build/timings.tsv _build/proofs TOTAL_SECONDS

The projection is deliberately pessimistic: every stage but the install is assumed to grow in
proportion to the number of chapters (unit tests, notebooks, pages and browser tests all do).
"""

import json
import sys
from pathlib import Path

CHAPTERS = 43
TARGET_NOW_S, TARGET_43_S, BUDGET_S = 15 * 60, 25 * 60, 20.0
ORDER = ["install", "lint", "unit", "nbval", "nbval-generic", "nbval-avx2", "book", "site-test"]


def main(timings: str, proofs: str, total: str) -> int:
    stages: dict[str, float] = {}
    for line in Path(timings).read_text(encoding="utf-8").splitlines():
        name, ms = line.split("\t")
        stages[name] = stages.get(name, 0.0) + int(ms) / 1000
    notebooks = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(Path(proofs).glob("*.json"))]
    n = max(len(notebooks), 1)

    print("\nstage        seconds")
    for name in sorted(stages, key=lambda s: ORDER.index(s) if s in ORDER else len(ORDER)):
        print(f"{name:<12} {stages[name]:7.1f}")
    measured = float(total)
    verdict = "ok" if measured <= TARGET_NOW_S else "OVER"
    print(f"{'all (wall)':<12} {measured:7.1f}   target <= {TARGET_NOW_S} s: {verdict}")
    if sum(stages.values()) > measured:
        print("(stages overlap: the book builds beside the second nbval stage, so they sum to more than the wall time)")

    print("\nslowest notebooks (nbval execution, one worker each)")
    for nb in sorted(notebooks, key=lambda d: -d["seconds"])[:5]:
        flag = "" if nb["seconds"] <= BUDGET_S else f"   OVER the {BUDGET_S:.0f} s budget"
        print(f"{nb['seconds']:7.1f} s  {nb['cells']:3d} cells  {nb['notebook']}{flag}")

    scaled = sum(v for k, v in stages.items() if k != "install")
    other = max(measured - sum(stages.values()), 0.0)  # clone clean-up, summary
    projected = stages.get("install", 0.0) + other + scaled * CHAPTERS / n
    print(f"\nprojection to {CHAPTERS} chapters ({n} measured; all stages but install x {CHAPTERS}/{n}): "
          f"{projected:.0f} s = {projected / 60:.1f} min, target <= {TARGET_43_S // 60} min: "
          f"{'ok' if projected <= TARGET_43_S else 'OVER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
