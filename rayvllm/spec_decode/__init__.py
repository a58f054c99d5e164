"""Speculative decoding: proposers (n-gram prompt lookup, a draft model),
the rejection sampler that verifies drafts, and the rule for which
requests may speculate. Ray-free, like the rest of the core."""
