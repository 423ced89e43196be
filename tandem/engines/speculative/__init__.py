"""Speculative decoding: proposers guess the next tokens, one target pass verifies them.

`config` parses `--speculative-config`; `proposer` holds the proposers' interface and prompt
lookup (`ngram` its index), `draft_model` the draft-model proposer, `eagle3` the EAGLE-3
proposer (`eagle3_head` its head and loader), `draft_kv` what both keep of their own paged KV;
`speculation` is the
engine's side (which requests speculate, what verification accepted, the policies);
`create` builds it for the reference engine. The batching engine appends proposals before a
step and verifies them after it (tandem.engines.batching.engine), the reference engine samples
a verify pass's rows (tandem.engines.reference.engine).
"""
