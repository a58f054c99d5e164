"""A second KV tier behind each rank's block pool (vLLM's KV offloading).

Prefix-cache blocks that the pool evicts are copied out to the tier; a later
request whose next prefix blocks the tier holds gets fresh blocks and their
KV copied back in, then counts them as prefix hits. Ray-free: the host tier
lives here; the Ray object store tier is an adapter (`ray_tier.py`) that only
the factory imports, and only when asked for.
"""
