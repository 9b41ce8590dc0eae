"""A GGUF file's tokenizer, built without torch.

transformers can build a fast tokenizer from a GGUF file's ``tokenizer.*`` metadata
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``), but its GGUF reader imports torch only to
hold tensors, and torch is not part of this project's base install (it is a multi-GB download on
most machines). This module reads the same metadata with the ``gguf`` package (already needed for
the weights) and hands it to transformers' own GGUF tokenizer converter, so the vocabulary,
merges, pre-tokenizer, special tokens and chat template are exactly transformers'. The result is
a ``PreTrainedTokenizerFast``; `tests/test_tokenizer.py` checks it against
``AutoTokenizer(gguf_file=...)`` token for token.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from medusa_jax.convert.gguf import field_value
from medusa_jax.convert.hf import ConversionError

#: The metadata keys that hold the token arrays (read in full; everything else is small).
_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def _converter():
    """(GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer) of the installed transformers.

    Raises ImportError when this transformers has neither module (they moved between releases).
    """
    try:  # transformers >= 5.x
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer


def gguf_tokenizer_metadata(reader) -> Tuple[str, Dict[str, Any], Dict[str, Any]]:
    """The tokenizer description of an open ``gguf.GGUFReader``, in transformers' terms.

    Returns:
      (architecture, tokenizer_dict, tokenizer_config): ``tokenizer_dict`` holds the vocabulary
      (``tokens``), ``merges``, ``token_type``, ``scores`` and the special ids under transformers'
      names (``GGUF_TOKENIZER_MAPPING["tokenizer"]``); ``tokenizer_config`` holds the chat template,
      the add-BOS/EOS flags and the special tokens' strings.
    Raises:
      ConversionError: the file has no tokenizer metadata.
    """

    mapping, _ = _converter()
    fields = reader.fields
    if "tokenizer.ggml.tokens" not in fields:
        raise ConversionError("the GGUF file holds no tokenizer (no tokenizer.ggml.tokens); pass a model "
                              "directory with tokenizer.json, or a GGUF exported with its tokenizer")

    def value(key):
        return field_value(fields[key]) if key in fields else None

    grouped = {group: {name: value(f"tokenizer.{key}") for key, name in renames.items()
                       if f"tokenizer.{key}" in fields}
               for group, renames in mapping.items()}
    tok, tok_cfg = grouped.get("tokenizer", {}), grouped.get("tokenizer_config", {})
    if tok.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to sentencepiece vocabularies by default
        tok_cfg.setdefault("add_bos_token", True)
    for name, key in _SPECIAL.items():
        idx = value(f"tokenizer.ggml.{key}")
        tok_cfg[name] = tok["tokens"][idx] if idx is not None and 0 <= idx < len(tok["tokens"]) else None
    return str(value("general.architecture")), tok, tok_cfg


def tokenizer_from_gguf(reader, source: str = "GGUF"):
    """A transformers fast tokenizer from an open ``gguf.GGUFReader``, without torch.

    Args:
      reader: ``gguf.GGUFReader`` (see `convert.gguf.open_gguf`).
      source: the file's name, for error messages.
    Returns:
      ``transformers.PreTrainedTokenizerFast`` with the file's chat template and special tokens.
    Raises:
      ConversionError: no tokenizer metadata, or a tokenizer type transformers cannot build.
      ImportError: the installed transformers has no GGUF tokenizer converter.
    """
    from transformers import PreTrainedTokenizerFast

    architecture, tok, tok_cfg = gguf_tokenizer_metadata(reader)
    _, convert = _converter()
    try:
        backend, extra = convert(architecture, tok)
    except (ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"{source}: cannot build its tokenizer ({type(e).__name__}: {e})") from e
    kwargs = {k: v for k, v in tok_cfg.items() if v is not None}
    kwargs.update(extra or {})
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
