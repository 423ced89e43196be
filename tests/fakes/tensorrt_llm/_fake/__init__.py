"""The fake's machinery (no upstream counterpart): a deterministic "model", a paged KV block
manager that emits upstream-shaped KV events, a step loop, and a TCP stand-in for the cache
transceiver so that a context-only request in one process can hand its KV to a
generation-only request in another."""
