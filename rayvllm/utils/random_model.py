"""Seeded random-initialised models with a locally built tokenizer.

No machine here reaches a model hub, so tests, benchmarks and the demo build
their models: a byte-level BPE tokenizer trained on generated text, padded with
filler tokens up to the model's vocabulary (so every id decodes), and a
transformers model initialised from a fixed seed and saved as safetensors.
The result is an ordinary HF model directory.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this "
    "which be are or an had not but were all have one their has more also who "
    "new after first two time can its been would into only other over when some "
    "world people year city state music river model engine token cache block "
    "water light small large early north south house game team school story "
    "hello ray serve fast paged attention batch queue prefix sample night day"
).split()

# ChatML; with tools, Hermes-style (as Qwen's): the tools as JSON in a
# system turn, calls as <tool_call>{...}</tool_call>, results in
# <tool_response> blocks. Without tools it renders as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% elif message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson }}{{ '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _corpus(seed: int, num_sentences: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ","]))
    return lines


def build_tokenizer(path: str | Path, vocab_size: int, seed: int = 0) -> None:
    """Write a fast tokenizer to `path` with exactly `vocab_size` ids.

    Ids 0..4 are <unk>, <s>, </s>, <|im_start|>, <|im_end|>; then byte-level
    BPE tokens; the rest are filler entries "<xN>" in the BPE vocabulary (not
    added tokens, which would slow encoding) that merges never produce.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe_size = min(vocab_size, 1024)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    filler = 0
    while next_id < vocab_size:
        name = f"<x{filler}>"
        filler += 1
        if name not in vocab:
            vocab[name] = next_id
            next_id += 1
    if next_id > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the base tokenizer ({next_id})")
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


@dataclass
class RandomModelSpec:
    """Shape of a random model; `arch` is one of gemma2, gemma3, granite, llama, mistral, olmo2, phi3, qwen2,
    qwen3."""

    arch: str = "llama"
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    initializer_range: float = 0.05
    # transformers initialises every RMSNorm weight to 1 (Gemma's, which
    # scale by 1 + weight, to 0), under which a norm weight loaded into the
    # wrong rows, or without Gemma's 1, goes unseen; > 0 adds N(0, norm_weight_std).
    norm_weight_std: float = 0.0
    seed: int = 0
    dtype: str = "float32"
    max_shard_size: str | None = None
    extra: dict = field(default_factory=dict)


def _hf_config(spec: RandomModelSpec):  # -> transformers.PretrainedConfig
    import transformers

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        **spec.extra,
    )
    if spec.head_dim is not None:
        common["head_dim"] = spec.head_dim
    if spec.rope_scaling is not None:
        common["rope_scaling"] = spec.rope_scaling
    if spec.arch == "llama":
        return transformers.LlamaConfig(**common)
    if spec.arch == "granite":
        return transformers.GraniteConfig(**common)
    if spec.arch == "olmo2":
        return transformers.Olmo2Config(**common)
    if spec.arch == "phi3":
        # Phi-3's default pad id (32,000) lies past a small vocabulary.
        return transformers.Phi3Config(**{"pad_token_id": 0, **common})
    if spec.arch == "mistral":
        # transformers' default window is 4,096 keys: none unless `extra` sets one.
        return transformers.MistralConfig(**{"sliding_window": None, **common})
    if spec.arch == "qwen2":
        return transformers.Qwen2Config(**{"use_sliding_window": False, **common})
    if spec.arch == "qwen3":
        return transformers.Qwen3Config(**{"use_sliding_window": False, **common})
    if spec.arch == "gemma2":
        return transformers.Gemma2Config(**common)
    if spec.arch == "gemma3":
        return transformers.Gemma3TextConfig(**common)
    raise ValueError(
        f"unknown arch {spec.arch!r}; expected gemma2, gemma3, granite, llama, mistral, olmo2, phi3, qwen2 or qwen3"
    )


def build_random_model(path: str | Path, spec: RandomModelSpec) -> Path:
    """Create (or reuse, if complete) a model directory for `spec` at `path`.

    Built aside and moved in: a process that reads the model while another
    builds the same one (the GPU proof's steps start side by side) finds it
    complete or not at all, never a config.json half written."""
    path = Path(path)
    marker = path / ".rayvllm-complete"
    if marker.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        _write_random_model(staging, spec)
        (staging / marker.name).write_text(json.dumps(spec.__dict__, default=str))
        try:
            staging.rename(path)  # whole, where `path` is missing or empty
        except OSError:
            if not marker.exists():  # `path` holds other files: each of ours replaces its own, the marker last
                for item in sorted(staging.iterdir(), key=lambda p: p.name == marker.name):
                    os.replace(item, path / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _write_random_model(path: Path, spec: RandomModelSpec) -> None:
    import torch
    import transformers

    build_tokenizer(path, spec.vocab_size, seed=spec.seed)
    config = _hf_config(spec)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    if spec.norm_weight_std > 0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * spec.norm_weight_std)
    kwargs = {"safe_serialization": True}
    if spec.max_shard_size is not None:
        kwargs["max_shard_size"] = spec.max_shard_size
    model.save_pretrained(str(path), **kwargs)
