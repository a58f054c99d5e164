"""Triton KV-cache and paged-attention kernels against the torch reference.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), with tiny shapes; with CUDA the same cases run natively
plus full-size ones. Every buffer a kernel must not read or write is poisoned
(NaN), so reading or writing the wrong place fails loudly.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rayvllm.kernels import reference, triton_attention  # noqa: E402
from rayvllm.kernels.attention_tiles import MAX_SPLITS, attention_tiles, is_tile_size, num_kv_splits  # noqa: E402
from rayvllm.kernels.kv_layout import KVCacheLayout, cache_strides, kv_cache_shapes  # noqa: E402
from rayvllm.kernels.triton_attention import paged_attention  # noqa: E402
from rayvllm.kernels.triton_kv_cache import reshape_and_cache  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SPLIT, NHD = KVCacheLayout.SPLIT, KVCacheLayout.NHD
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Output tolerances: fp32 is exact math up to summation order; half types
# round P (fed to the second dot) and the output.
TOL = {F32: dict(atol=2e-5, rtol=1e-4), F16: dict(atol=3e-3, rtol=1e-2), BF16: dict(atol=2e-2, rtol=2e-2)}
NAN = float("nan")


def _gen(case_id: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(case_id.encode()))


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _to_layout(split_key_cache: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """A SPLIT key cache `[blocks, kvh, D, bs]` in `layout` (a fresh tensor)."""
    if layout is NHD:
        return split_key_cache.permute(0, 3, 1, 2).contiguous()
    return split_key_cache.clone()


def _to_split(key_cache: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    return key_cache.permute(0, 2, 3, 1) if layout is NHD else key_cache


def test_layout_shapes_and_strides_address_the_same_element() -> None:
    num_blocks, block_size, kv_heads, head_size = 3, 8, 2, 5
    for layout in KVCacheLayout:
        k_shape, v_shape = kv_cache_shapes(layout, num_blocks, block_size, kv_heads, head_size)
        assert v_shape == (num_blocks, block_size, kv_heads, head_size)
        key = torch.arange(torch.Size(k_shape).numel()).view(k_shape)
        split = _to_split(key, layout)
        assert split.shape == (num_blocks, kv_heads, head_size, block_size)
        strides = cache_strides(key, layout, is_key=True)
        for block, off, head, dim in [(0, 0, 0, 0), (2, 7, 1, 4), (1, 3, 0, 2)]:
            flat = sum(i * s for i, s in zip((block, off, head, dim), strides))
            assert key.view(-1)[flat] == split[block, head, dim, off]
        value = torch.empty(v_shape)
        assert cache_strides(value, layout, is_key=False) == value.stride()


# ---------------------------------------------------------------- reshape_and_cache


def _rac_case(*args: object) -> object:
    layout, src, cache, slot, kvh, d, bs = args
    name = f"{layout.name}-{str(src)[6:]}-to-{str(cache)[6:]}-{str(slot)[6:]}-kvh{kvh}-d{d}-bs{bs}"
    return pytest.param(*args, id=name)


@pytest.mark.parametrize(
    "layout,src_dtype,cache_dtype,slot_dtype,kv_heads,head_size,block_size",
    [
        _rac_case(SPLIT, F32, F32, torch.int64, 2, 32, 8),
        _rac_case(NHD, F32, F32, torch.int32, 3, 48, 16),
        _rac_case(SPLIT, BF16, BF16, torch.int32, 1, 80, 32),
        _rac_case(NHD, F16, F16, torch.int64, 2, 64, 8),
        _rac_case(SPLIT, F32, BF16, torch.int64, 2, 48, 16),
        _rac_case(NHD, BF16, F16, torch.int32, 4, 32, 16),
    ],
)
def test_reshape_and_cache_matches_reference(
    layout: KVCacheLayout,
    src_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    slot_dtype: torch.dtype,
    kv_heads: int,
    head_size: int,
    block_size: int,
) -> None:
    gen = _gen(f"rac-{layout}-{src_dtype}-{cache_dtype}-{kv_heads}-{head_size}-{block_size}")
    num_blocks, num_tokens = 6, 19
    # Strided inputs, as a slice of a fused QKV projection would be.
    kv = _randn(gen, num_tokens, 2 * kv_heads + 1, head_size, dtype=src_dtype)
    key, value = kv[:, :kv_heads], kv[:, kv_heads + 1 :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:4]] = -1
    slots = slots.to(device=DEVICE, dtype=slot_dtype)

    split_k_shape, v_shape = kv_cache_shapes(SPLIT, num_blocks, block_size, kv_heads, head_size)
    expected_k = torch.full(split_k_shape, NAN, dtype=cache_dtype, device=DEVICE)
    expected_v = torch.full(v_shape, NAN, dtype=cache_dtype, device=DEVICE)
    reference.reshape_and_cache(
        key.to(cache_dtype), value.to(cache_dtype), expected_k, expected_v, slots.long(), has_negative_slots=True
    )
    key_cache = _to_layout(torch.full_like(expected_k, NAN), layout)
    value_cache = torch.full_like(expected_v, NAN)
    reshape_and_cache(key, value, key_cache, value_cache, slots, layout=layout)

    # The interpreter truncates fp32 -> bf16 (a GPU rounds to nearest even):
    # allow that one ulp there, demand bit equality everywhere else.
    truncates = not ON_GPU and src_dtype == F32 and cache_dtype == BF16
    tol = dict(atol=0.0, rtol=2**-7 if truncates else 0.0)
    torch.testing.assert_close(_to_split(key_cache, layout), expected_k, equal_nan=True, **tol)
    torch.testing.assert_close(value_cache, expected_v, equal_nan=True, **tol)


# ---------------------------------------------------------------- paged_attention


@dataclass(frozen=True)
class Case:
    """One attention batch: sequence b brings `q_lens[b]` new tokens at the
    end of a context of `seq_lens[b]` tokens."""

    name: str
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    dtype: torch.dtype = F32
    layout: KVCacheLayout = SPLIT
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 32
    block_size: int = 16
    block_m: int | None = None
    block_n: int | None = None
    index_dtype: torch.dtype = torch.int32  # of seq_lens and block_tables
    max_query_len: int | None = None  # None: the true maximum
    num_splits: int | None = None  # None: the kernel's choice from max(seq_lens)
    window: int | None = None  # a sliding window of that many keys
    softcap: float | None = None  # Gemma 2's cap on the scaled scores

    def __str__(self) -> str:
        return self.name


def _ragged(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


_DECODE_LENS = dict(q_lens=(1,) * 5, seq_lens=(1, 9, 16, 17, 40))
# decode, decode, fresh prefill, prefill whose cached prefix (13) ends
# mid-block, a sequence with nothing to do this step, decode.
_MIXED_LENS = dict(q_lens=(1, 1, 7, 6, 0, 1), seq_lens=(24, 3, 7, 19, 11, 33))

CPU_CASES = [
    Case("decode-f32-split", **_DECODE_LENS),
    Case("decode-f32-nhd-mha-bs8", **_DECODE_LENS, layout=NHD, kv_heads=4, block_size=8),
    Case("decode-bf16-gqa4-d48", **_DECODE_LENS, dtype=BF16, heads=8, head_size=48),
    Case("decode-f16-nhd-gqa3-bs32", **_DECODE_LENS, dtype=F16, layout=NHD, heads=6, head_size=48, block_size=32),
    Case("mixed-f32-split-d80", **_MIXED_LENS, head_size=80, block_size=8),
    Case("mixed-f32-nhd-gqa4-bs32", **_MIXED_LENS, layout=NHD, heads=8, block_size=32),
    Case("mixed-bf16-nhd-d80", **_MIXED_LENS, dtype=BF16, layout=NHD, head_size=80, block_size=8),
    Case("mixed-f16-split-mha-int64", **_MIXED_LENS, dtype=F16, kv_heads=4, index_dtype=torch.int64),
    Case("mixed-bf16-split-gqa4-bs32", **_MIXED_LENS, dtype=BF16, heads=8, block_size=32),
    # Several query tiles per sequence and several KV tiles per block (and
    # the reverse), with a prefix that ends mid-block.
    Case("chunked-f32-small-tiles", q_lens=(21, 2), seq_lens=(34, 2), block_m=16, block_n=16, block_size=32),
    Case(
        "chunked-bf16-nhd-small-tiles", q_lens=(0, 19), seq_lens=(5, 27), dtype=BF16, layout=NHD,
        block_m=16, block_n=16, block_size=8,
    ),
    Case("chunked-f16-gqa4-d48", q_lens=(9, 12, 1), seq_lens=(12, 40, 3), dtype=F16, heads=8, head_size=48, block_m=16),
    # max_query_len only sizes tiles: an understated one must still be right.
    Case("chunked-f32-nhd-understated-max", q_lens=(1, 17), seq_lens=(9, 20), layout=NHD, max_query_len=1),
    # Split-KV. 150 keys in 4 splits of 48 (tiles of 16): the last split holds
    # 6; the 37-key context leaves split 3 empty, the 5-key one splits 1-3.
    Case("split4-decode-f32-bs8", q_lens=(1,) * 3, seq_lens=(150, 37, 5), block_size=8, block_n=16, num_splits=4),
    Case(
        "split8-decode-bf16-nhd-gqa4-d64", q_lens=(1,) * 3, seq_lens=(200, 64, 1), dtype=BF16, layout=NHD,
        heads=8, head_size=64, block_n=16, num_splits=8,
    ),
    Case("split4-decode-f32-mha-d256-bs32", q_lens=(1, 1), seq_lens=(90, 17), heads=2, kv_heads=2,
         head_size=256, block_size=32, block_n=16, num_splits=4),
    Case("split2-decode-f16-gqa3-d80", q_lens=(1, 1), seq_lens=(75, 40), dtype=F16, heads=6, head_size=80,
         block_size=8, block_n=16, num_splits=2),
    # Prefill tiles split too: rows whose causal limit falls before a split
    # see nothing there.
    Case("split2-mixed-f16-nhd-d128", q_lens=(1, 9, 0, 1), seq_lens=(70, 40, 5, 33), dtype=F16, layout=NHD,
         head_size=128, block_m=16, block_n=16, num_splits=2),
    # The kernel's own choice: two sequences give 2 programs, so a 600-key
    # context splits in two (test_num_kv_splits_rule checks the count).
    Case("auto-split-decode-f32-gqa4", q_lens=(1, 1), seq_lens=(600, 300), heads=4, kv_heads=1),
    # Sliding windows: shorter than some contexts and longer than others, a
    # window of one key, windows starting mid-block and mid-tile, with splits.
    Case("window-mixed-f32-bs8", **_MIXED_LENS, block_size=8, window=5),
    Case("window-decode-bf16-nhd-gqa4", **_DECODE_LENS, dtype=BF16, layout=NHD, heads=8, window=12),
    Case("window1-mixed-f16", **_MIXED_LENS, dtype=F16, window=1),
    Case("window-chunked-f32-small-tiles", q_lens=(21, 2), seq_lens=(34, 2), block_m=16, block_n=16,
         block_size=32, window=9),
    Case("window-decode-split4-f32-bs8", q_lens=(1,) * 3, seq_lens=(150, 37, 5), block_size=8, block_n=16,
         num_splits=4, window=40),
    Case("window-split2-mixed-f16-nhd", q_lens=(1, 9, 0, 1), seq_lens=(70, 40, 5, 33), dtype=F16, layout=NHD,
         head_size=128, block_m=16, block_n=16, num_splits=2, window=17),
    # Soft-capped scores (a cap below the scores' spread, so it bites), alone and windowed with splits.
    Case("softcap-mixed-f32", **_MIXED_LENS, softcap=0.5),
    Case("softcap-window-split2-bf16-nhd", q_lens=(1, 9, 1), seq_lens=(70, 40, 33), dtype=BF16, layout=NHD,
         block_m=16, block_n=16, num_splits=2, window=17, softcap=2.0),
]

GPU_CASES = [
    Case(
        "gpu-decode-bf16-d128-gqa4", q_lens=(1,) * 64, seq_lens=_ragged(64, 1, 2048, 1),
        dtype=BF16, heads=32, kv_heads=8, head_size=128,
    ),
    Case(
        "gpu-decode-f16-nhd-d64", q_lens=(1,) * 48, seq_lens=_ragged(48, 1, 1500, 2),
        dtype=F16, layout=NHD, heads=16, kv_heads=16, head_size=64, block_size=32,
    ),
    Case(
        "gpu-mixed-bf16-nhd-d128", q_lens=(1,) * 30 + (300, 517, 0, 64),
        seq_lens=_ragged(30, 1, 2000, 3) + (300, 1901, 77, 1000),
        dtype=BF16, layout=NHD, heads=32, kv_heads=8, head_size=128,
    ),
    Case(
        "gpu-mixed-f16-d80-gqa2", q_lens=(1,) * 32 + (129, 33), seq_lens=_ragged(32, 1, 1024, 4) + (1029, 33),
        dtype=F16, heads=16, kv_heads=8, head_size=80, block_size=8,
    ),
    Case("gpu-prefill-f32-d64", q_lens=(1000, 250), seq_lens=(2047, 250), heads=8, kv_heads=2, head_size=64),
    # Long-context decodes of a few sequences: the kernel's own split-KV choice.
    Case(
        "gpu-long-decode-bf16-d128-gqa4", q_lens=(1,) * 4, seq_lens=_ragged(4, 8000, 32768, 5),
        dtype=BF16, layout=NHD, heads=32, kv_heads=8, head_size=128,
    ),
    Case(
        "gpu-long-decode-f16-nhd-d64-mha", q_lens=(1, 1), seq_lens=(16384, 4097),
        dtype=F16, layout=NHD, heads=16, kv_heads=16, head_size=64,
    ),
    Case(
        "gpu-long-decode-bf16-d256-bs32", q_lens=(1,) * 3, seq_lens=(12000, 257, 7000),
        dtype=BF16, layout=NHD, heads=8, kv_heads=2, head_size=256, block_size=32,
    ),
    Case(
        "gpu-long-mixed-bf16-d128", q_lens=(1, 1, 128), seq_lens=(20000, 9000, 4096),
        dtype=BF16, layout=NHD, heads=32, kv_heads=8, head_size=128,
    ),
    Case("gpu-split16-f32-d128", q_lens=(1,) * 2, seq_lens=(30000, 3000), heads=8, kv_heads=2, head_size=128,
         num_splits=16),
    Case(
        "gpu-window-mixed-bf16-d128", q_lens=(1,) * 16 + (700, 64), seq_lens=_ragged(16, 1, 9000, 6) + (700, 5000),
        dtype=BF16, layout=NHD, heads=32, kv_heads=8, head_size=128, window=4096,
    ),
]

CASES = CPU_CASES + (GPU_CASES if ON_GPU else [])


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, heads, D], a strided view
    split_key_cache: torch.Tensor  # the key cache in SPLIT layout, for the oracle
    key_cache: torch.Tensor  # in the case's layout
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


def _build_batch(case: Case) -> PagedBatch:
    """Caches filled with each sequence's whole context through the reference
    `reshape_and_cache`, in blocks handed out in shuffled order. Unused blocks
    stay NaN, and the block tables are padded with the id of a NaN block, so
    a kernel that reads past a sequence's context reads NaN."""
    gen = _gen(case.name)
    bs, kvh, d = case.block_size, case.kv_heads, case.head_size
    blocks_needed = [-(-n // bs) for n in case.seq_lens]
    max_blocks = max(blocks_needed) + 1
    num_blocks = sum(blocks_needed) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    poison_block, free = order[0], iter(order[1:])
    block_tables = torch.full((len(case.seq_lens), max_blocks), poison_block, dtype=torch.int32)
    split_k_shape, v_shape = kv_cache_shapes(SPLIT, num_blocks, bs, kvh, d)
    split_key_cache = torch.full(split_k_shape, NAN, dtype=case.dtype, device=DEVICE)
    value_cache = torch.full(v_shape, NAN, dtype=case.dtype, device=DEVICE)
    for b, (n, nblocks) in enumerate(zip(case.seq_lens, blocks_needed)):
        block_tables[b, :nblocks] = torch.tensor([next(free) for _ in range(nblocks)], dtype=torch.int32)
        pos = torch.arange(n)
        slots = (block_tables[b, pos // bs].long() * bs + pos % bs).to(DEVICE)
        k, v = _randn(gen, n, kvh, d, dtype=case.dtype), _randn(gen, n, kvh, d, dtype=case.dtype)
        reference.reshape_and_cache(k, v, split_key_cache, value_cache, slots)
    num_tokens = sum(case.q_lens)
    qkv = _randn(gen, num_tokens, case.heads + 2 * kvh, d, dtype=case.dtype)
    cu = torch.tensor((0,) + case.q_lens).cumsum(0).to(torch.int32)
    return PagedBatch(
        query=qkv[:, : case.heads],
        split_key_cache=split_key_cache,
        key_cache=_to_layout(split_key_cache, case.layout),
        value_cache=value_cache,
        query_start_loc=cu.to(DEVICE),
        seq_lens=torch.tensor(case.seq_lens, dtype=case.index_dtype, device=DEVICE),
        block_tables=block_tables.to(device=DEVICE, dtype=case.index_dtype),
    )


def _oracle(case: Case, batch: PagedBatch, scale: float) -> torch.Tensor:
    """Per sequence: the reference's `gather_context` and SDPA in float32."""
    out = torch.full(batch.query.shape, NAN, dtype=F32, device=DEVICE)
    start = 0
    for b, (q_len, n) in enumerate(zip(case.q_lens, case.seq_lens)):
        if q_len:
            block_ids = batch.block_tables[b, : -(-n // case.block_size)].long()
            k, v = reference.gather_context(batch.split_key_cache, batch.value_cache, block_ids, n)
            q = batch.query[start : start + q_len].float().transpose(0, 1)[None]
            k, v = k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None]
            keys = torch.arange(n, device=DEVICE)[None, :]
            positions = torch.arange(n - q_len, n, device=DEVICE)[:, None]
            allowed = keys <= positions
            if case.window is not None:
                allowed &= keys > positions - case.window
            if case.softcap is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
            else:
                group = q.shape[1] // k.shape[1]
                scores = torch.tanh(q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale / case.softcap)
                weights = (scores * case.softcap).masked_fill(~allowed, float("-inf")).softmax(-1)
                o = weights @ v.repeat_interleave(group, 1)
            out[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_attention_matches_reference(case: Case) -> None:
    batch = _build_batch(case)
    scale = case.head_size**-0.5
    num_tokens = batch.query.shape[0]
    # A strided `out` whose padding columns must stay NaN.
    out_storage = torch.full((num_tokens, case.heads, case.head_size + 3), NAN, dtype=case.dtype, device=DEVICE)
    out = out_storage[..., : case.head_size]
    result = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_query_len=case.max_query_len or max(case.q_lens),
        max_seq_len=max(case.seq_lens),
        scale=scale,
        layout=case.layout,
        out=out,
        block_m=case.block_m,
        block_n=case.block_n,
        num_splits=case.num_splits,
        window=case.window,
        softcap=case.softcap,
    )
    assert result is out
    assert torch.isnan(out_storage[..., case.head_size :]).all()
    torch.testing.assert_close(out.float(), _oracle(case, batch, scale), **TOL[case.dtype])


def test_num_kv_splits_rule() -> None:
    """Splits only when programs are scarce and contexts long; a power of 2."""
    assert num_kv_splits(2, 600) == 2  # the auto-split case above
    assert num_kv_splits(40, 32768) == 4  # 4 sequences x 8 KV heads (+1 spare tile each)
    assert num_kv_splits(4, 1 << 20) == MAX_SPLITS
    assert num_kv_splits(8, 300) == 1  # one split's worth of keys
    assert num_kv_splits(64 * 8, 32768) == 1  # a full batch fills the GPU already
    assert num_kv_splits(40, 32768, sm_count=16) == 1
    assert all(n & (n - 1) == 0 for n in (num_kv_splits(p, 8192) for p in range(1, 300)))
    assert triton_attention._launch_splits(torch.device("cpu"), 2, 600) == 2
    assert triton_attention._launch_splits(torch.device("cpu"), 2, None) == 1


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_tiles_per_head_size(head_size: int, dtype: torch.dtype) -> None:
    """Decode and prefill tiles are valid tl.dot shapes; a step's K and V
    tiles stay within 32 KB (wide heads and float32 take fewer keys), and
    warps grow with the accumulator."""
    elem = dtype.itemsize
    decode = attention_tiles(head_size, elem, group_padded=4, max_query_len=1)
    prefill = attention_tiles(head_size, elem, group_padded=4, max_query_len=512)
    for tiles in (decode, prefill):
        assert is_tile_size(tiles.block_m) and is_tile_size(tiles.block_n)
        assert 2 * tiles.block_n * head_size * elem <= 32 << 10 and tiles.num_warps in (4, 8)
    assert (decode.block_m, prefill.block_m) == (16, 64)
    assert decode.block_n == {(64, 2): 128, (128, 2): 64, (256, 2): 32, (64, 4): 64, (128, 4): 32, (256, 4): 16}[
        head_size, elem
    ]
    assert prefill.num_warps >= decode.num_warps
    with pytest.raises(ValueError, match="block_n"):
        attention_tiles(head_size, elem, 4, 1, block_n=24)


def test_split_count_must_be_a_power_of_2() -> None:
    k_shape, v_shape = kv_cache_shapes(NHD, 2, 8, 1, 32)
    key_cache, value_cache = torch.zeros(k_shape, device=DEVICE), torch.zeros(v_shape, device=DEVICE)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(
            torch.zeros(1, 1, 32, device=DEVICE), key_cache, value_cache, layout=NHD, num_splits=3,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([1], dtype=torch.int32, device=DEVICE),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), max_query_len=1, scale=1.0,
        )


@pytest.mark.parametrize("layout", [SPLIT, NHD])
def test_one_step_write_then_attend(layout: KVCacheLayout) -> None:
    """A model step as the runner runs it: the new tokens' K/V go in through
    the Triton `reshape_and_cache` (with two trailing padding tokens whose
    slot is -1), then `paged_attention` reads everything from the cache. The
    padding tokens belong to no sequence: their output rows stay untouched."""
    case = Case(f"step-{layout.name}", q_lens=(1, 5, 1, 11), seq_lens=(10, 21, 1, 11), layout=layout, kv_heads=1)
    batch = _build_batch(case)
    gen = _gen(case.name + "-new")
    # Overwrite the new tokens' cached K/V with fresh values: the kernel
    # writes the caches under test, the reference the oracle's copies.
    new_slots = []
    for b, (q_len, n) in enumerate(zip(case.q_lens, case.seq_lens)):
        pos = torch.arange(n - q_len, n, device=DEVICE)
        block_ids = batch.block_tables[b, pos // case.block_size].long()
        new_slots.append(block_ids * case.block_size + pos % case.block_size)
    pad = 2
    slots = torch.cat(new_slots + [torch.full((pad,), -1, device=DEVICE)])
    num_tokens = slots.shape[0]
    new_k = _randn(gen, num_tokens, case.kv_heads, case.head_size)
    new_v = _randn(gen, num_tokens, case.kv_heads, case.head_size)
    expected_values = batch.value_cache.clone()
    reference.reshape_and_cache(
        new_k, new_v, batch.split_key_cache, expected_values, slots, has_negative_slots=True
    )
    reshape_and_cache(new_k, new_v, batch.key_cache, batch.value_cache, slots, layout=layout)
    exact = dict(atol=0.0, rtol=0.0, equal_nan=True)
    torch.testing.assert_close(_to_split(batch.key_cache, layout), batch.split_key_cache, **exact)
    torch.testing.assert_close(batch.value_cache, expected_values, **exact)

    query = torch.cat([batch.query, _randn(gen, pad, case.heads, case.head_size)])
    out = torch.full_like(query, NAN)
    paged_attention(
        query,
        batch.key_cache,
        batch.value_cache,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_query_len=max(case.q_lens),
        scale=0.3,
        layout=layout,
        out=out,
    )
    assert torch.isnan(out[-pad:]).all()
    torch.testing.assert_close(out[:-pad], _oracle(case, batch, 0.3)[: num_tokens - pad], **TOL[F32])


def test_paged_attention_rejects_mismatched_shapes() -> None:
    k_shape, v_shape = kv_cache_shapes(NHD, 4, 8, 2, 32)
    key_cache, value_cache = torch.zeros(k_shape, device=DEVICE), torch.zeros(v_shape, device=DEVICE)
    kwargs = dict(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([1], dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
        max_query_len=1,
        scale=1.0,
    )
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(torch.zeros(1, 3, 32, device=DEVICE), key_cache, value_cache, layout=NHD, **kwargs)
    with pytest.raises(ValueError, match="layout SPLIT"):
        paged_attention(torch.zeros(1, 4, 32, device=DEVICE), key_cache, value_cache, layout=SPLIT, **kwargs)


# Compiled for an H100 (sm_90) with Triton's bundled ptxas, no GPU needed:
# the interpreter accepts code the compiler rejects. Integer arguments are
# specialised as the JIT would for contiguous caches (unit dim strides,
# 16-aligned pointers and strides).
_COMPILE_SCRIPT = r'''
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rayvllm.kernels import triton_attention as ta
from rayvllm.kernels.attention_tiles import attention_tiles

UNIT = {"stride_qd", "stride_od", "kc_stride_dim", "vc_stride_dim", "stride_bt_block"}
INDEX = {"query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"}


def compile_kernel(fn, consts, dtype):
    options = dict(num_warps=consts.pop("num_warps"), num_stages=consts.pop("num_stages", 2))
    sig, attrs = {}, {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*i32" if name in INDEX else "*fp32" if name.startswith("split") else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in UNIT:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
            if "stride" in name:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


shared = {}
for dtype, elem, head, splits, q_len in json.loads(sys.argv[1]):
    tiles = attention_tiles(head, elem, 4, q_len)
    consts = dict(BLOCK_SIZE=16, BLOCK_Q=tiles.block_m // 4, GROUP_PADDED=4, BLOCK_N=tiles.block_n,
                  HEAD_SIZE_PADDED=head, UPCAST=False, DOT_PRECISION="ieee" if elem == 4 else "tf32",
                  NUM_SPLITS=splits, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    shared[f"{dtype}-d{head}-s{splits}-q{q_len}"] = compile_kernel(ta._paged_attention_kernel, consts, dtype).metadata.shared
    if splits > 1:
        merge = dict(NUM_SPLITS=splits, HEAD_SIZE_PADDED=head, num_warps=4)
        shared[f"merge-{dtype}-d{head}-s{splits}"] = compile_kernel(ta._merge_splits_kernel, merge, dtype).metadata.shared
print(json.dumps(shared))
'''


@pytest.mark.skipif(ON_GPU, reason="the GPU run compiles every case natively")
def test_kernels_compile_for_sm90() -> None:
    import json
    import os
    import subprocess
    import sys

    configs = [("bf16", 2, 128, 1, 1), ("bf16", 2, 128, 8, 1), ("bf16", 2, 256, 32, 128), ("fp32", 4, 64, 4, 128)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(configs)], capture_output=True, text=True, env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    shared = json.loads(result.stdout.splitlines()[-1])
    assert len(shared) == 7
    # Well inside any GPU since Ampere (an H100 has 228 KB per SM).
    assert max(shared.values()) <= 100 << 10, shared
