"""llmbook: executable equations for large language models, retrieval and agents.

Every public function implements one or more equations of the book's catalogue; see
``python -m llmbook equations`` and :mod:`llmbook.registry`.

``llmbook.flash_attention(q, k, v, causal=..., backend="auto")`` is loaded on first use, so that
``import llmbook`` never imports the kernels or Triton.
"""

from llmbook.registry import catalogue, implements

__version__ = "0.1.0"
__all__ = ["catalogue", "implements", "flash_attention", "__version__"]


def __getattr__(name):
    if name == "flash_attention":  # lazy: importing llmbook must not import the kernels or triton
        from llmbook.kernels.flash_attention import flash_attention

        return flash_attention
    raise AttributeError(f"module 'llmbook' has no attribute {name!r}")
