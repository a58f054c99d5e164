"""Multi-LoRA serving: adapters from PEFT directories, slots in the batch,
one batched LoRA matmul per projection (vLLM's `enable_lora`)."""
