"""Attention kernels against the torch reference (and the reference against
plain dense attention), on random inputs with ragged lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rayvllm.kernels import cpu_attention
from rayvllm.kernels.cpu_isa import ISAS, cpu_info, selected_isa
from rayvllm.kernels.metadata import AttentionMetadata, PrefillSeq
from rayvllm.kernels.reference import gather_keys, paged_attention, reshape_and_cache


def _require(isa: str, available) -> None:
    """Skip unless this CPU runs `isa` and the kernel built for it."""
    if not cpu_info().supports(isa):
        pytest.skip(f"this CPU ({cpu_info().model}) cannot run the {isa} variant")
    if not available(isa):
        pytest.skip("no C compiler")


def _random_cache(num_blocks: int, block_size: int, kv_heads: int, head_size: int, gen: torch.Generator):
    """Keys [blocks, kv_heads, head_size, block_size], values [blocks, block_size, kv_heads, head_size]."""
    keys = torch.randn(num_blocks, kv_heads, head_size, block_size, generator=gen)
    return keys, torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen)


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int, window: int | None = None,
    softcap: float | None = None,
):
    """q [q, H, D], k/v [L, KVH, D]; query j sees keys <= causal_offset + j
    (and with a window of W, only the W up to there); scores capped to
    softcap * tanh(s / softcap) when given."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    last = (causal_offset + torch.arange(q.shape[0]))[:, None]
    allowed = torch.arange(k.shape[0])[None, :] <= last
    if window is not None:
        allowed &= torch.arange(k.shape[0])[None, :] > last - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size,head_size", [(16, 32), (16, 48), (16, 128), (8, 48), (4, 64)])
@pytest.mark.parametrize("window,softcap", [(None, None), (21, None), (21, 0.7)])
def test_c_decode_kernel_matches_reference(
    isa: str, heads: int, kv_heads: int, block_size: int, head_size: int, window: int | None, softcap: float | None
) -> None:
    """Against dense attention; with a window, every block-table entry
    before a token's first key names block 0, which is all NaN (a freed
    block may hold anything): the kernel must not read it. A soft cap
    below the scores' spread, so that it bites."""
    _require(isa, cpu_attention.available)
    gen = torch.Generator().manual_seed(heads * 1000 + block_size * 10 + head_size)
    num_blocks, max_blocks, num_seqs = 64, 12, 7
    k_cache, v_cache = _random_cache(num_blocks, block_size, kv_heads, head_size, gen)
    block_tables = torch.stack([torch.randperm(num_blocks - 1, generator=gen)[:max_blocks] + 1 for _ in range(num_seqs)])
    ctx_lens = torch.randint(1, max_blocks * block_size + 1, (num_seqs,), generator=gen)
    rows = torch.randperm(num_seqs, generator=gen)  # tokens use rows out of order
    lens_by_token = ctx_lens[rows].contiguous()
    q = torch.randn(num_seqs, heads, head_size, generator=gen)
    scale = head_size**-0.5
    read_tables = block_tables.clone()
    if window is not None:
        k_cache[0], v_cache[0] = float("nan"), float("nan")
        for seq in range(num_seqs):
            read_tables[seq, : max(0, int(ctx_lens[seq]) - window) // block_size] = 0
    out = cpu_attention.paged_attention(
        q, k_cache, v_cache, read_tables, rows.contiguous(), lens_by_token, scale, isa=isa, window=window,
        softcap=softcap,
    )
    flat_v = v_cache.view(-1, kv_heads, head_size)
    for t in range(num_seqs):
        n = int(lens_by_token[t])
        pos = torch.arange(n)
        slots = block_tables[rows[t], pos // block_size] * block_size + pos % block_size
        expected = _dense_attention(q[t : t + 1], gather_keys(k_cache, slots), flat_v[slots], scale, n - 1, window, softcap)
        torch.testing.assert_close(out[t : t + 1], expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,kv_heads", [(6, 6), (8, 2), (4, 1)])
@pytest.mark.parametrize("head_size", [16, 48, 128])
@pytest.mark.parametrize("window,softcap", [(None, None), (21, None), (21, 0.7)])
def test_c_prefill_kernel_matches_dense(
    isa: str, heads: int, kv_heads: int, head_size: int, window: int | None, softcap: float | None
) -> None:
    """Prefills of several sequences (fresh, over a cached prefix, one token,
    runs that end mid-block) through the prefill kernel, read from a cache
    whose unwritten slots are NaN, against dense causal attention and bit
    for bit against the decode kernel; through `paged_attention` too, whose
    metadata sends the prefill rows there. With a window, the block-table
    entries before a sequence's first query's first key name block 0 (NaN)."""
    _require(isa, cpu_attention.available)
    block_size = 16
    gen = torch.Generator().manual_seed(heads * 100 + head_size)
    seqs = [(0, 37), (21, 16), (5, 1), (0, 9), (40, 23)]  # (cached tokens, new tokens)
    num_blocks = 40
    k_cache, v_cache = _random_cache(num_blocks, block_size, kv_heads, head_size, gen)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    block_tables = torch.zeros(len(seqs), 5, dtype=torch.int64)
    free = iter(torch.randperm(num_blocks - 1, generator=gen).tolist())
    rows, lens, queries, expected = [], [], [], []
    scale = head_size**-0.5
    for i, (cached, new) in enumerate(seqs):
        total = cached + new
        for b in range(-(-total // block_size)):
            block_tables[i, b] = next(free) + 1
        pos = torch.arange(total)
        k = torch.randn(total, kv_heads, head_size, generator=gen)
        v = torch.randn(total, kv_heads, head_size, generator=gen)
        reshape_and_cache(k, v, k_cache, v_cache, block_tables[i, pos // block_size] * block_size + pos % block_size)
        if window is not None:
            block_tables[i, : max(0, cached + 1 - window) // block_size] = 0
        q = torch.randn(new, heads, head_size, generator=gen)
        queries.append(q)
        rows += [i] * new
        lens.append(torch.arange(cached + 1, total + 1))
        expected.append(_dense_attention(q, k, v, scale, cached, window, softcap))
    q, seq_rows, ctx_lens = torch.cat(queries), torch.tensor(rows), torch.cat(lens)
    out = cpu_attention.paged_attention(q, k_cache, v_cache, block_tables, seq_rows, ctx_lens, scale, isa=isa,
                                        prefill=True, window=window, softcap=softcap)
    torch.testing.assert_close(out, torch.cat(expected), atol=2e-5, rtol=1e-4)
    # The same bits as the decode kernel's, token by token (batch-invariant mode relies on it).
    decode = cpu_attention.paged_attention(
        q, k_cache, v_cache, block_tables, seq_rows, ctx_lens, scale, isa=isa, window=window, softcap=softcap
    )
    assert torch.equal(out, decode)
    if isa == selected_isa():
        md = AttentionMetadata(slot_mapping=torch.zeros(len(rows), dtype=torch.int64), num_decode_tokens=0, prefills=[],
                               block_tables=block_tables, prefill_seq_rows=seq_rows, prefill_ctx_lens=ctx_lens)
        through = paged_attention(q, q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache, md, scale, window, softcap)
        torch.testing.assert_close(through, torch.cat(expected), atol=2e-5, rtol=1e-4)


def test_prefill_kernel_shapes_and_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block size 16 and head sizes that are multiples of 16, on the AVX-512
    build only (the others measured slower than SDPA); the engine keeps the
    rest on the torch path."""
    if not cpu_attention.available():
        pytest.skip("no C compiler")
    on_avx512 = selected_isa() == "avx512"
    assert cpu_attention.supports_prefill(48, 16) == on_avx512 == cpu_attention.supports_prefill(128, 16)
    assert not cpu_attention.supports_prefill(40, 16) and not cpu_attention.supports_prefill(64, 32)
    monkeypatch.setenv("RAYVLLM_CPU_ISA", "portable")
    assert not cpu_attention.supports_prefill(48, 16)


@pytest.mark.parametrize("use_c", [False, True])
@pytest.mark.parametrize("softcap", [None, 0.7])
def test_reference_mixed_batch_matches_dense(use_c: bool, softcap: float | None) -> None:
    """Decodes plus a fresh prefill plus a prefill over a cached prefix, through
    reshape_and_cache and paged_attention, against dense attention (with
    soft-capped scores too: torch's path computes them itself, SDPA has no cap)."""
    if use_c and not cpu_attention.available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_size, block_size, num_blocks = 8, 2, 32, 4, 40
    k_cache, v_cache = _random_cache(num_blocks, block_size, kv_heads, head_size, gen)
    k_cache.fill_(float("nan"))  # poisoned: only written slots may be read
    v_cache.fill_(float("nan"))
    # Sequence contents: (cached tokens already in the cache, new tokens this step).
    seqs = [(5, 1), (9, 1), (0, 6), (7, 5)]
    block_tables = torch.zeros(len(seqs), 8, dtype=torch.int64)
    free = iter(torch.randperm(num_blocks - 1, generator=gen).tolist())
    full_k, full_v, slots_all = [], [], []
    for i, (cached, new) in enumerate(seqs):
        total = cached + new
        for b in range(-(-total // block_size)):
            block_tables[i, b] = next(free) + 1
        pos = torch.arange(total)
        slots = block_tables[i, pos // block_size] * block_size + pos % block_size
        k = torch.randn(total, kv_heads, head_size, generator=gen)
        v = torch.randn(total, kv_heads, head_size, generator=gen)
        reshape_and_cache(k[:cached], v[:cached], k_cache, v_cache, slots[:cached])
        full_k.append(k)
        full_v.append(v)
        slots_all.append(slots)
    q_lens = [new for _, new in seqs]
    q = torch.randn(sum(q_lens), heads, head_size, generator=gen)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs)])
    slot_mapping = torch.cat([s[c:] for s, (c, _) in zip(slots_all, seqs)])
    md = AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=2, prefills=[])
    if use_c:
        md.block_tables = block_tables
        md.decode_seq_rows = torch.tensor([0, 1])
        md.decode_ctx_lens = torch.tensor([6, 10])
    else:
        L = 10
        pos = torch.arange(L)
        md.decode_kv_index = block_tables[:2, pos // block_size] * block_size + pos % block_size
        md.decode_mask = (pos[None, :] < torch.tensor([6, 10])[:, None])[:, None, None, :]
    start = 2
    for i in (2, 3):
        cached, new = seqs[i]
        total = cached + new
        block_ids = mask = None
        if cached:
            block_ids = block_tables[i, : -(-total // block_size)]
            mask = torch.arange(total)[None, :] <= (cached + torch.arange(new))[:, None]
        md.prefills.append(PrefillSeq(start, start + new, total, block_ids, mask))
        start += new
    scale = head_size**-0.5
    reshape_and_cache(new_k, new_v, k_cache, v_cache, slot_mapping)
    out = torch.full_like(q, float("nan"))
    out.copy_(paged_attention(q, new_k, new_v, k_cache, v_cache, md, scale, softcap=softcap))
    start = 0
    for i, (cached, new) in enumerate(seqs):
        expected = _dense_attention(q[start : start + new], full_k[i], full_v[i], scale, cached, softcap=softcap)
        torch.testing.assert_close(out[start : start + new], expected, atol=2e-5, rtol=1e-4)
        start += new


def test_reshape_and_cache_skips_negative_slots() -> None:
    k_cache = torch.zeros(3, 1, 4, 2)  # [blocks, kv_heads, head_size, block_size]
    v_cache = torch.zeros(3, 2, 1, 4)  # [blocks, block_size, kv_heads, head_size]
    key = torch.arange(12, dtype=torch.float32).view(3, 1, 4) + 1
    reshape_and_cache(key, -key, k_cache, v_cache, torch.tensor([2, -1, 5]), has_negative_slots=True)
    # slot 2 = block 1, position 0; slot 5 = block 2, position 1
    assert torch.equal(k_cache[1, 0, :, 0], key[0, 0]) and torch.equal(k_cache[2, 0, :, 1], key[2, 0])
    assert k_cache[0].abs().sum() == 0 and k_cache[1, :, :, 1].abs().sum() == 0 and k_cache[2, :, :, 0].abs().sum() == 0
    assert torch.equal(v_cache.view(-1, 4)[5], -key[2, 0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [37, 700])  # one thread; enough work for two
def test_fused_add_rms_norm_matches_torch(isa: str, rows: int) -> None:
    from rayvllm.kernels import cpu_ops
    from rayvllm.layers.layernorm import RMSNorm

    _require(isa, cpu_ops.available)
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    residual = torch.randn(rows, 96, generator=gen)
    expected, expected_res = norm.forward_with_residual(x, residual.clone())
    expected_plain = norm(x)
    got_res = residual.clone()
    got = cpu_ops.add_rms_norm(x, got_res, norm.weight, norm.eps, isa=isa)
    torch.testing.assert_close(got_res, expected_res, atol=0, rtol=0)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    plain = cpu_ops.add_rms_norm(x, None, norm.weight, norm.eps, isa=isa)
    torch.testing.assert_close(plain, expected_plain, atol=1e-6, rtol=1e-5)
    # The layer's own C path (the default variant) returns the residual it updated.
    norm.use_c_kernel = True
    got_res = residual.clone()
    got, returned = norm.forward_with_residual(x, got_res)
    assert returned is got_res
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_silu_and_mul_matches_torch(isa: str) -> None:
    from rayvllm.kernels import cpu_ops

    _require(isa, cpu_ops.available)
    gen = torch.Generator().manual_seed(5)
    # 37 rows: one thread and a ragged vector tail; extremes: exp's clamp and both signs.
    gate_up = torch.randn(37, 2 * 83, generator=gen) * 8
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30])
    gate, up = gate_up.split(83, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up, isa=isa), expected, atol=1e-6, rtol=2e-6)
    rows = torch.randn(600, 2 * 64, generator=gen)  # enough work for two threads
    gate, up = rows.split(64, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_and_mul(rows, isa=isa), F.silu(gate) * up, atol=1e-6, rtol=2e-6)


def test_silu_runs_in_c_only_where_it_beats_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable build's SiLU is slower than torch's (no vector round or
    blend on the x86-64 baseline): a model on that variant keeps torch's."""
    from rayvllm.distributed.parallel_state import ParallelContext
    from rayvllm.kernels import cpu_ops
    from rayvllm.layers.layernorm import RMSNorm
    from rayvllm.models import llama

    if not cpu_ops.available("portable"):
        pytest.skip("no C compiler")
    assert not cpu_ops.silu_and_mul_ahead("portable")
    for isa in ("avx512", "avx2"):
        if cpu_info().supports(isa) and cpu_ops.available(isa):
            assert cpu_ops.silu_and_mul_ahead(isa)
    monkeypatch.setattr(cpu_ops, "silu_and_mul_ahead", lambda isa=None: False)
    mlp = llama.LlamaMLP(8, 16, ParallelContext())
    rms = RMSNorm(8, 1e-6)
    llama.LlamaForCausalLM.optimize_for_cpu(torch.nn.ModuleList([mlp, rms]), use_c_kernels=True)  # type: ignore[arg-type]
    assert rms.use_c_kernel and not mlp.use_c_kernel


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,kv_heads,head_size", [(4, 2, 32), (6, 6, 48)])
def test_fused_rope_and_cache_matches_torch(isa: str, heads: int, kv_heads: int, head_size: int) -> None:
    from rayvllm.kernels import cpu_ops
    from rayvllm.layers.rotary import RotaryEmbedding

    _require(isa, cpu_ops.available)
    gen = torch.Generator().manual_seed(heads + head_size)
    rope = RotaryEmbedding(head_size, 512, 10000.0, None, torch.float32)
    num_tokens, q_size, kv_size = 21, heads * head_size, kv_heads * head_size
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, heads, head_size)
    k = k.view(num_tokens, kv_heads, head_size)
    v = v.view(num_tokens, kv_heads, head_size)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    slots = torch.randperm(40, generator=gen)[:num_tokens]
    slots[3] = -1
    key_cache = torch.full((10, kv_heads, head_size, 4), float("nan"))
    value_cache = torch.full((10, 4, kv_heads, head_size), float("nan"))
    q_rot, k_rot = cpu_ops.rope_and_cache(q, k, v, positions, rope.cos, rope.sin, slots, key_cache, value_cache, isa=isa)
    exp_q, exp_k = rope(positions, q, k)
    # Same rounding as torch's elementwise ops: bit-identical.
    assert torch.equal(q_rot, exp_q) and torch.equal(k_rot, exp_k)
    flat_v = value_cache.view(-1, kv_heads, head_size)
    keep = slots >= 0
    assert torch.equal(gather_keys(key_cache, slots[keep]), exp_k[keep])
    assert torch.equal(flat_v[slots[keep]], v[keep])
    written = torch.zeros(40, dtype=torch.bool)
    written[slots[keep]] = True
    assert torch.isnan(gather_keys(key_cache, torch.arange(40)[~written])).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 5, 6, 7, 12, 13, 200, 421])
@pytest.mark.parametrize("n,k", [(32, 7), (50, 288), (864, 288), (288, 768)])
def test_packed_gemm_matches_float64(isa: str, m: int, n: int, k: int) -> None:
    """Each variant's GEMM within float32 rounding of the float64 product:
    row counts around the microkernels' blocks (6 or 12 rows) and row chunks
    (96 or 192), padded last tiles (50 columns) and an odd K. Not bitwise:
    the sum over K runs in order but with FMA on AVX2/AVX-512."""
    from rayvllm.kernels import cpu_gemm

    _require(isa, cpu_gemm.available)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    tile = cpu_gemm.tile_cols(isa)
    assert tile == {"avx512": 48, "avx2": 16, "portable": 8}[isa]
    packed = cpu_gemm.pack_weight(weight, isa)
    assert packed.shape == (-(-n // tile), k, tile)
    got = cpu_gemm.gemm(x, packed, n, isa)
    assert got.shape == (m, n)
    expected = (x.double() @ weight.double().t()).float()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(32, 7), (50, 288), (200, 33)])
def test_pack_weight_is_the_tiled_transpose(isa: str, threads: int, n: int, k: int) -> None:
    """The packing, exactly: column tiles `[tile][k][TILE]` of W's rows, the
    last tile's missing columns zero, whatever `out` held before (a weight
    update repacks into the old packing) and however many threads split
    the tiles."""
    from rayvllm.kernels import cpu_gemm

    _require(isa, cpu_gemm.available)
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    tile = cpu_gemm.tile_cols(isa)
    tiles = -(-n // tile)
    padded = torch.zeros(tiles * tile, k)
    padded[:n] = weight
    expected = padded.view(tiles, tile, k).transpose(1, 2)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = torch.full((tiles, k, tile), float("nan"))
        assert cpu_gemm.pack_weight(weight, isa, out=out) is out
        assert torch.equal(out, expected)
        assert torch.equal(cpu_gemm.pack_weight(weight, isa), expected)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(1, 1), (33, 7), (50, 288), (200, 65)])
def test_transpose_is_exact(isa: str, threads: int, n: int, k: int) -> None:
    """torch.mm's `[in, out]` layout of a weight, exactly, into an `out` full
    of NaN (a weight update rewrites the old layout), blocks partial at
    both edges, however many threads split the rows; a wrong `out` is refused."""
    from rayvllm.kernels import cpu_gemm

    _require(isa, cpu_gemm.available)
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = torch.full((k, n), float("nan"))
        assert cpu_gemm.transpose(weight, out, isa) is out
        assert torch.equal(out, weight.t())
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(ValueError, match="out"):
        cpu_gemm.transpose(weight, torch.empty(n, k + 1), isa)


@pytest.mark.parametrize("isa", ISAS)
def test_apply_token_bitmask_matches_torch(isa: str) -> None:
    """The grammar mask: words of zeros, of ones and mixed, a vocabulary
    that ends inside a word, a subset of rows (the others untouched)."""
    from rayvllm.kernels import cpu_ops
    from rayvllm.structured_output.bitmask import apply_token_bitmask_torch_

    _require(isa, cpu_ops.available)
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 70, 1000 + 13
    words = -(-vocab // 32)
    density = torch.rand(rows, 1, generator=gen)  # per row: from almost nothing allowed to almost all
    allowed = torch.rand(rows, words * 32, generator=gen) < density
    allowed[0], allowed[1] = False, True
    bitmask = (allowed.view(rows, words, 32).int() << torch.arange(32)).sum(-1).int()
    logits = torch.randn(rows, vocab, generator=gen)
    picked = [r for r in range(rows) if r % 4 != 3]
    expected = logits.clone()
    apply_token_bitmask_torch_(expected, bitmask, picked)
    cpu_ops.apply_token_bitmask_(logits, bitmask, torch.tensor(picked), isa=isa)
    assert torch.equal(logits, expected)
