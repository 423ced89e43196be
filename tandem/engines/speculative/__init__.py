"""Speculative decoding: proposers guess the next tokens, one target pass verifies them.

The pieces are independent of the engine (vLLM v1's `spec_decode/` shape): `config` parses
`--speculative-config`, `ngram` proposes from the context without weights, `rejection` decides
which proposals the target accepts (the sampler owns acceptance, so the engine's step does not
change).
"""
