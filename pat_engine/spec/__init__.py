"""Speculative decoding without a draft model (docs/speculative.md)."""
