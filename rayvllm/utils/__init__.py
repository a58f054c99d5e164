"""Helpers with no engine knowledge: where files are cached, tokenizer
loading, and the seeded random checkpoints behind the demo model and tests."""
