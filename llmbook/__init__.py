"""llmbook: executable equations for large language models, retrieval and agents.

Every public function implements one or more equations of the book's catalogue; see
``python -m llmbook equations`` and :mod:`llmbook.registry`.
"""

from llmbook.registry import catalogue, implements

__version__ = "0.1.0"
__all__ = ["catalogue", "implements", "__version__"]
