"""Images in requests: fetching, decoding, hashing, preprocessing, placeholder tokens and the
encoder cache. Used by the frontend (fetch, validate, hash, expand placeholders) and by engines
that run a vision encoder (preprocess, cache)."""
