"""Interactive explorers: a tested computation, a live view and a kernel-free static view."""

from llmbook.widgets.explorer import Explorer, Param

__all__ = ["Explorer", "Param"]
