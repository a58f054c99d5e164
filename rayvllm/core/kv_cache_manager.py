"""Per-request KV block bookkeeping on top of `BlockPool`, with automatic
prefix caching (vLLM v1 semantics).

The scheduler speaks only tokens to this class:

1. ``get_computed_blocks(request)`` -> prefix-hit blocks and how many tokens
   they cover (always a multiple of ``block_size``, never the last token);
2. ``allocate_slots(request, num_new_tokens, hits, num_hit_tokens)`` -> new
   blocks, or None when the pool cannot supply them (then nothing changed);
3. ``free(request)`` when it finishes or is preempted.

With a second KV tier (`kv_tier`), evicted cached blocks are stored there,
and between 1 and 2 ``load_from_tier(request, hits)`` may instead start
copying the request's next blocks in from the tier (the request then waits
for its step to come back: ``finish_transfers``); each step carries the
copies as ``take_transfers()``. core/kv_offload_manager.py has the protocol.

The two first calls must be made back to back for one request (no other
allocation in between), because the hit blocks may be free-but-cached and could
otherwise be evicted before they are touched.

Blocks are hashed (registered in the prefix cache) as soon as scheduled tokens
fill them, before their KV is actually written. That is sound because a later
request can only read them in a later forward pass, or in the same one after
the model runner has written each layer's KV before attention reads it.

Sliding window (`sliding_window` W, given only when every attention layer
of every model writing these blocks has a window, W the largest: see
`rayvllm.models.honoured.kv_window`). A step's queries sit at positions
>= the request's computed tokens c, and a query at p reads keys from
p - W + 1 on; so once c is known, the blocks wholly before c - W + 1 are
read by no query ever again, and `allocate_slots` releases them to the pool
(cached ones stay in the prefix cache, evictable, as a finished request's
do: the listener, block events and the DP prefix index among them, hears of
one only when the pool hands it out again, and a second tier then stores
it like any evicted block). Their entries in the request's block table become the null block, so
the table keeps its length (position p stays in entry p // block_size) and
a request holds at most ceil((W - 1) / block_size) + 1 blocks while it
decodes, ceil((W + n - 2) / block_size) + 1 while it computes n tokens a
step, whatever its length. c never goes back while a request holds blocks:
a speculative step's rejected drafts are taken back only down to the count
it was allocated at plus one, and preemption frees the whole table. With a
full-attention layer (Qwen2 below max_window_layers, Gemma's alternation,
mixed layer_types) every key stays readable through the one table all
layers share, so nothing is released (W is None).
"""

from __future__ import annotations

from collections.abc import Sequence

from rayvllm.core.block_pool import BlockPool, BlockPoolListener, KVCacheBlock
from rayvllm.core.kv_offload_manager import KVOffloadManager
from rayvllm.core.kv_tier import KVTier
from rayvllm.core.request import Request
from rayvllm.messages.block_hash import BlockHash, hash_block_tokens, request_extra_keys
from rayvllm.messages.engine_types import KVOffloadStats, PrefixCacheStats
from rayvllm.messages.kv_transfers import KVTransfers


class KVCacheManager:
    """Owns which blocks each request holds and the prefix-cache hash chains.

    Per-request invariants (for every ``request_id`` with blocks):
    ``req_to_blocks[id][i]`` holds tokens ``[i*block_size, (i+1)*block_size)``,
    except that its first ``num_released_blocks[id]`` entries (0 without a
    sliding window) are the null block: released, read by no later query;
    ``num_cached_blocks[id] <= len(req_to_blocks[id])`` counts the leading
    blocks already registered in the pool's hash map (released ones
    included: a released block was registered first, where its tokens were
    known);
    ``req_to_block_hashes[id][i]`` is the chain hash of the request's full
    block ``i`` and is only ever extended (tokens are append-only).

    `listener` is handed to the `BlockPool` unchanged, so an outside index
    (e.g. `PrefixIndex` for data-parallel routing) can mirror which hashes this
    cache holds.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        *,
        listener: BlockPoolListener | None = None,
        kv_tier: KVTier | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """`sliding_window`: release the blocks that far behind each
        request's computed tokens (see the module docstring); None: keep
        every block until the request is freed."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching, listener)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.num_released_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.offload: KVOffloadManager | None = None
        if kv_tier is not None and enable_caching:
            self.offload = KVOffloadManager(kv_tier, self.block_pool, block_size)
            self.block_pool.on_evict = self.offload.on_evict

    # ------------------------------------------------------------------ queries

    @property
    def usage(self) -> float:
        """Fraction of usable KV blocks owned by requests (0.0 .. 1.0)."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, including evictable cached ones."""
        return self.block_pool.get_num_free_blocks()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds none); released
        entries are the null block's id, 0."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_num_blocks(self, request_id: str) -> int:
        """Entries in the request's block table, released ones included."""
        return len(self.req_to_blocks.get(request_id, ()))

    def get_num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds: its table's entries less the released ones."""
        return self.get_num_blocks(request_id) - self.num_released_blocks.get(request_id, 0)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters since the previous call; the internal counters restart at 0."""
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    # --------------------------------------------------------------- prefix hit

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks matching the request's prefix.

        Returns ``(blocks, num_tokens_covered)``. At most
        ``(num_tokens - 1) // block_size`` blocks match, so the last token is
        always recomputed (its logits are needed to sample). Does not take
        references: pass the result straight to `allocate_slots`.
        Requests with ``prompt_logprobs`` or mean pooling skip the lookup
        (and the stats), since every prompt position must be computed for them.
        """
        if not self.enable_caching or not request.reads_prefix_cache:
            return [], 0
        hashes = self._update_block_hashes(request)
        max_hit_blocks = max(request.num_tokens - 1, 0) // self.block_size
        pool = self.block_pool
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = pool.get_cached_block(block_hash)
            if block is None:
                # Hashes chain, so no later block can match either.
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    # ------------------------------------------------------------ second tier

    def load_from_tier(self, request: Request, hit_blocks: Sequence[KVCacheBlock]) -> bool:
        """After `get_computed_blocks` found `hit_blocks`: True when the tier
        holds the request's next blocks and a copy into fresh blocks is
        queued for this step; the request must then wait for
        `finish_transfers` to name it, and not be allocated meanwhile."""
        if self.offload is None or not request.reads_prefix_cache:
            return False
        hashes = self.req_to_block_hashes.get(request.request_id, [])
        max_blocks = max(request.num_tokens - 1, 0) // self.block_size
        if not self.offload.start_load(request.request_id, hashes, hit_blocks, max_blocks):
            return False
        # The lookup is counted again, hits included, when the request is scheduled.
        stats = self.prefix_cache_stats
        stats.requests -= 1
        stats.queries -= request.num_tokens
        stats.hits -= len(hit_blocks) * self.block_size
        return True

    def take_transfers(self) -> KVTransfers | None:
        """The tier copies this step's workers must make (None: none)."""
        return self.offload.take_transfers() if self.offload is not None else None

    def finish_transfers(self, transfers: KVTransfers, failed_block_ids: Sequence[int]) -> list[str]:
        """A step carrying `transfers` came back: the requests whose loads
        are done and that may be scheduled again."""
        assert self.offload is not None
        return self.offload.finish(transfers, failed_block_ids)

    def make_offload_stats(self) -> KVOffloadStats | None:
        """Tier counters since the previous call; None without a tier."""
        return self.offload.make_stats() if self.offload is not None else None

    # --------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make the request's blocks cover
        ``num_computed_tokens + num_new_computed_tokens + num_new_tokens`` tokens.

        `new_computed_blocks` (prefix hits from `get_computed_blocks`, covering
        exactly `num_new_computed_tokens`) are referenced and appended first;
        the rest is allocated fresh. With a sliding window, the blocks no
        query from ``num_computed_tokens + num_new_computed_tokens`` on can
        read are released first (hits among them are not referenced at
        all), and count as supply. Returns only the freshly allocated blocks
        (possibly empty), or None — with no state changed — when the pool
        cannot supply them. Then registers in the prefix cache every block
        that the known tokens fill.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        hits: Sequence[KVCacheBlock] = new_computed_blocks or ()
        if num_new_computed_tokens != len(hits) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{len(hits)} hit blocks of size {self.block_size}"
            )
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        if hits and (req_blocks or request.num_computed_tokens):
            # Hits extend a request from token 0; anything else would misplace them.
            raise ValueError(f"prefix-hit blocks given for request {req_id} that already has KV")

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_needed_tokens = num_computed + num_new_tokens
        num_held = len(req_blocks) if req_blocks else 0
        num_to_allocate = (
            -(-num_needed_tokens // self.block_size) - num_held - len(hits)
        )
        # Held blocks are released from the last release on; hits come only
        # with an empty table, and those before the window are skipped.
        first_needed = self._first_needed_block(num_computed)
        num_released = self.num_released_blocks.get(req_id, 0)
        to_release = req_blocks[num_released:first_needed] if req_blocks else []
        kept_hits = hits[first_needed:]

        pool = self.block_pool
        if num_to_allocate > 0 or hits or to_release:
            # Free-but-cached hits sit in the free queue; touching removes them,
            # so they cannot also count as supply for fresh blocks. Released
            # blocks no other request holds join that queue.
            num_evictable_hits = sum(1 for b in kept_hits if b.ref_cnt == 0 and not b.is_null)
            num_freed = sum(1 for b in to_release if b.ref_cnt == 1)
            if num_to_allocate > pool.get_num_free_blocks() + num_freed - num_evictable_hits:
                return None
            if req_blocks is None:
                req_blocks = self.req_to_blocks[req_id] = []
            if to_release:
                self._release(request, req_blocks, first_needed)
            if hits:
                # Touch before allocating so eviction cannot take the hit blocks.
                pool.touch(kept_hits)
                num_skipped = len(hits) - len(kept_hits)
                if num_skipped:
                    req_blocks.extend([pool.null_block] * num_skipped)
                    self.num_released_blocks[req_id] = num_skipped
                req_blocks.extend(kept_hits)
                # Hit blocks are already hashed; skip them when caching.
                self.num_cached_blocks[req_id] = len(hits)
            new_blocks = pool.get_new_blocks(num_to_allocate) if num_to_allocate > 0 else []
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []

        if self.enable_caching and req_blocks:
            # Only tokens whose ids are known can be hashed (lookahead slots are not).
            self._cache_blocks(request, req_blocks, min(num_needed_tokens, request.num_tokens) // self.block_size)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, and forget the request.

        Reverse order puts the tail of the sequence nearest the front of the
        free queue, so it is evicted before the shared-prefix head, which is
        the part other requests are most likely to hit. Safe to call for a
        request that holds no blocks.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks:
            # Released entries are the null block, which the pool skips.
            self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(req_id, None)
        self.num_released_blocks.pop(req_id, None)
        self.req_to_block_hashes.pop(req_id, None)
        if self.offload is not None:
            self.offload.release(req_id)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes; False (and nothing done) while blocks are owned."""
        if not self.block_pool.reset_prefix_cache():
            return False
        # No request owns blocks, so no per-request cached count can be stale;
        # clear any left over from requests that never got blocks anyway.
        self.num_cached_blocks.clear()
        return True

    # ------------------------------------------------------------------ helpers

    def _first_needed_block(self, num_computed: int) -> int:
        """The first block a query at a position >= `num_computed` can read
        (0 without a sliding window): the one holding num_computed - W + 1."""
        if self.sliding_window is None:
            return 0
        return max(num_computed - self.sliding_window + 1, 0) // self.block_size

    def _release(self, request: Request, req_blocks: list[KVCacheBlock], first_needed: int) -> None:
        """Give the pool the request's blocks before `first_needed` that it
        still holds, leaving the null block in their entries."""
        req_id = request.request_id
        start = self.num_released_blocks.get(req_id, 0)
        if self.enable_caching:
            # Register them first where their tokens are known (a block filled
            # by accepted drafts is not yet): released, they stay hits.
            self._cache_blocks(request, req_blocks, min(first_needed, request.num_tokens // self.block_size))
        released = req_blocks[start:first_needed]
        req_blocks[start:first_needed] = [self.block_pool.null_block] * len(released)
        # Latest first, as `free` orders them: the head, which other
        # requests share most, is evicted last.
        self.block_pool.free_blocks(reversed(released))
        self.num_released_blocks[req_id] = first_needed

    def _cache_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_full: int) -> None:
        """Register the request's blocks up to `num_full` (whose tokens are
        known and scheduled) in the prefix cache; released entries are skipped."""
        req_id = request.request_id
        num_cached = self.num_cached_blocks.get(req_id, 0)
        if num_full > num_cached:
            hashes = self._update_block_hashes(request)
            self.block_pool.cache_full_blocks(req_blocks, hashes, num_cached, num_full)
            self.num_cached_blocks[req_id] = num_full

    def _update_block_hashes(self, request: Request) -> list[BlockHash]:
        """Extend the request's hash list to cover all its currently full blocks.

        Incremental: each full block is hashed once over the request's life
        (until `free`), so decode steps cost nothing until a block fills.
        """
        req_id = request.request_id
        hashes = self.req_to_block_hashes.get(req_id)
        if hashes is None:
            hashes = self.req_to_block_hashes[req_id] = []
        bs = self.block_size
        num_full = request.num_tokens // bs
        if len(hashes) < num_full:
            tokens = request.all_token_ids
            parent: BlockHash | None = hashes[-1] if hashes else None
            for i in range(len(hashes), num_full):
                extra = request_extra_keys(request.cache_salt, request.lora_int_id) if i == 0 else None
                parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra)
                hashes.append(parent)
        return hashes
