from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.kv.hashing import block_hashes, hash_block

TOKENS = list(range(100, 170))  # 70 tokens: 4 full blocks of 16 and a partial one


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(TOKENS, 16)) == 4
    assert block_hashes(TOKENS[:15], 16) == []
    assert len(block_hashes(TOKENS[:64], 16)) == 4


def test_hashes_are_64_bit_unsigned_and_chained() -> None:
    hashes = block_hashes(TOKENS, 16)
    assert all(0 <= h < 2**64 for h in hashes)
    assert hashes[0] == hash_block(None, TOKENS[:16])
    assert hashes[1] == hash_block(hashes[0], TOKENS[16:32])
    assert len(set(hashes)) == 4


def test_a_different_parent_changes_the_hash_of_identical_tokens() -> None:
    block = TOKENS[:16]
    assert hash_block(None, block) != hash_block(1, block)
    assert hash_block(1, block) != hash_block(2, block)
    # "no parent" is not the same as parent 0
    assert hash_block(None, block) != hash_block(0, block)


def test_changing_an_early_token_changes_every_later_block() -> None:
    changed = list(TOKENS)
    changed[3] += 1
    a, b = block_hashes(TOKENS, 16), block_hashes(changed, 16)
    assert all(x != y for x, y in zip(a, b))
    # ...while a change in block 2 leaves blocks 0-1 alone
    changed = list(TOKENS)
    changed[40] += 1
    c = block_hashes(changed, 16)
    assert c[:2] == a[:2] and c[2] != a[2] and c[3] != a[3]


def test_continuing_a_chain_from_a_parent_hash() -> None:
    full = block_hashes(TOKENS, 16)
    assert block_hashes(TOKENS[32:], 16, parent_hash=full[1]) == full[2:]


def test_multimodal_hashes_change_the_blocks_they_touch_and_later_ones() -> None:
    plain = block_hashes(TOKENS, 16)
    with_image = block_hashes(TOKENS, 16, mm_hashes_per_block=[(), ("img-a",)])
    other_image = block_hashes(TOKENS, 16, mm_hashes_per_block=[(), ("img-b",)])
    assert with_image[0] == plain[0]
    assert with_image[1] != plain[1] and with_image[1] != other_image[1]
    assert with_image[2] != plain[2]
    assert hash_block(None, [1, 2], ("ab", "c")) != hash_block(None, [1, 2], ("a", "bc"))


def test_token_boundaries_are_unambiguous() -> None:
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2, 0])
    assert hash_block(None, [256]) != hash_block(None, [0, 1])


def test_same_value_in_another_process_and_golden() -> None:
    # Deterministic across processes (Python's hash() is salted per process) and across
    # releases: routers and workers of different builds must agree.
    code = ("from tandem.kv.hashing import block_hashes;"
            "print(block_hashes(list(range(100, 170)), 16))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert out.strip() == str(block_hashes(TOKENS, 16))
    assert hash_block(None, [1, 2, 3]) == GOLDEN_1_2_3


GOLDEN_1_2_3 = 468332143640581275


def test_invalid_input() -> None:
    with pytest.raises(ValueError):
        block_hashes(TOKENS, 0)
    with pytest.raises(OverflowError):
        hash_block(None, [-1])
