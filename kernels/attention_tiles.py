"""Launch shapes of the Triton paged-attention kernel: tile sizes per head
size, and how many programs share one tile's keys (split-KV, i.e.
flash-decoding). Plain Python, so the choices are testable without Triton.

Why split. A decode step gives the kernel one program per (sequence, KV
head). With a few sequences of long context that is far fewer programs than
the GPU has multiprocessors, and each walks thousands of keys alone: the
step is bound by one SM's bandwidth, not the chip's. Splitting every tile's
keys across `num_splits` programs, each writing a partial softmax (max, sum,
unnormalised output) that a second small kernel merges, fills the chip.
Splits cost that merge and a float32 round trip of the partials, so they
are taken only when programs are scarce and contexts long.
"""

from __future__ import annotations

from dataclasses import dataclass

# Each split walks at least this many keys, so the merge stays small next
# to the attention itself.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
# Programs to aim for: two per multiprocessor hides one program's latency
# behind another's. Off a GPU (the interpreter) an H100's 132 SMs stand in,
# so tests take the decisions a GPU would.
PROGRAMS_PER_SM = 2
DEFAULT_SM_COUNT = 132
# Shared memory per pipeline stage of the key loop, and the stages: 96 KB
# in all, inside every GPU since Ampere (an H100 has 228 KB per SM).
_STEP_TILE_BYTES = 32 << 10
_PIPELINE_STAGES = 3


@dataclass(frozen=True)
class AttentionTiles:
    """`block_m`: score rows per program (queries x padded GQA group);
    `block_n`: keys per inner step; `num_warps`/`num_stages`: Triton's."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def is_tile_size(n: int) -> bool:
    """tl.dot needs every tile dimension to be a power of 2 and at least 16."""
    return n >= 16 and not n & (n - 1)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _keys_per_step(head_size_padded: int, elem_bytes: int) -> int:
    """One step's K and V tiles ([head_size, block_n] each) take at most
    `_STEP_TILE_BYTES`, so `_PIPELINE_STAGES` of them fit in any recent GPU's
    shared memory: wide heads and float32 take fewer keys per step; narrow
    half-precision heads more, which gives a decode more loads in flight."""
    fit = _STEP_TILE_BYTES // (2 * head_size_padded * elem_bytes)
    return max(16, min(128, 1 << (fit.bit_length() - 1)))


def attention_tiles(
    head_size_padded: int,
    elem_bytes: int,
    group_padded: int,
    max_query_len: int,
    block_m: int | None = None,
    block_n: int | None = None,
) -> AttentionTiles:
    """Tiles for one launch over a cache of `elem_bytes`-wide values. Rows
    are few for decode-heavy steps (most would be padding) and up to 64 when
    sequences bring many queries; `block_m` and `block_n` override the choice
    (tuning, tests)."""
    if block_m is None:
        block_m = min(64, max(16, next_power_of_2(max(max_query_len, 1)) * group_padded))
        block_m = max(block_m, group_padded)
    if not is_tile_size(block_m) or block_m < group_padded:
        raise ValueError(f"block_m must be a power of 2 >= max(16, padded GQA group {group_padded}), got {block_m}")
    if block_n is None:
        block_n = _keys_per_step(head_size_padded, elem_bytes)
    if not is_tile_size(block_n):
        raise ValueError(f"block_n must be a power of 2 >= 16, got {block_n}")
    # The float32 accumulator is block_m x head_size: past 8K values per
    # program, 4 warps would spill it.
    num_warps = 4 if block_m * head_size_padded <= 64 * 128 else 8
    stages = _PIPELINE_STAGES if head_size_padded <= 128 else _PIPELINE_STAGES - 1
    return AttentionTiles(block_m, block_n, num_warps, stages)


def num_kv_splits(num_programs: int, max_seq_len: int, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """How many programs share each tile's keys: 1 (no split) when the launch
    already has `PROGRAMS_PER_SM` programs per multiprocessor or contexts
    are short; else enough to get there, each split keeping at least
    `MIN_SPLIT_TOKENS` keys of a `max_seq_len` context. A power of 2 (the
    merge kernel loads all splits as one tile), at most `MAX_SPLITS`.
    `num_programs`: programs of the unsplit launch; `max_seq_len`: a host
    upper bound of the batch's context lengths."""
    target = PROGRAMS_PER_SM * sm_count
    if num_programs >= target:
        return 1
    wanted = min(-(-target // num_programs), max_seq_len // MIN_SPLIT_TOKENS, MAX_SPLITS)
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1
