"""Package data: the equation catalogue, the notation table and an offline corpus."""

from importlib import resources


def corpus() -> str:
    """The frozen offline English text used by the language-model examples (see README.md here)."""
    return resources.files(__name__).joinpath("corpus.txt").read_text(encoding="utf-8")
