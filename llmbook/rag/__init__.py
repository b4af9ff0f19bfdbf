"""Part II: retrieval and retrieval-augmented generation."""
