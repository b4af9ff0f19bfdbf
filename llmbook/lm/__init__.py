"""Part I: language models (probability, blocks, attention, decoding, ...)."""
