"""The OpenAI-compatible API: request/response models (`protocol`) and the
HTTP-free serving logic (`serving`, helped by `streams` and `logprobs`).
The HTTP app lives beside them and is the only part that knows about a web
framework or Ray."""
