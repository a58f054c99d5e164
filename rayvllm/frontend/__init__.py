"""The engine's front: prompts in (Processor: tokenize, validate), text out
(OutputProcessor, detokenizer), and the metrics recorded on the way."""
