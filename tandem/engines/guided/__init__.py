"""Structured outputs: GuidedDecoding constraints as xgrammar grammars (grammar.py), compiled
once per constraint against a model's vocabulary and followed token by token per request
(matcher.py)."""
