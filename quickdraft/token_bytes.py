"""The bytes each token of a tokenizer stands for, read the same way for byte-level BPE ("Ġthe"), SentencePiece
("▁the", <0xC3> byte fallback) and plain vocabularies: what a draft with another tokenizer matches tokens by
(drafts/vocab_mapping.py) and what structured outputs build a grammar's tokenizer from (structured.py)."""

from __future__ import annotations

import json
from typing import Any

_METASPACE = "\u2581"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (byte-level BPE vocabularies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE_LEVEL_DECODE = {c: b for b, c in _bytes_to_unicode().items()}


def decoder_kinds(tokenizer: Any) -> set[str]:
    """What the tokenizer's decoder does to a piece: 'byte_level', 'metaspace', 'byte_fallback' (none: the piece
    is its text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    kinds: set[str] = set()

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if kind == "ByteLevel":
            kinds.add("byte_level")
        elif kind == "Metaspace" or (kind == "Replace" and node.get("pattern", {}).get("String") == _METASPACE):
            kinds.add("metaspace")
        elif kind == "ByteFallback":
            kinds.add("byte_fallback")
        for child in node.get("decoders") or ():
            walk(child)

    walk(json.loads(backend.to_str()).get("decoder"))
    return kinds


def token_bytes(tokenizer: Any) -> tuple[dict[int, bytes], set[int], dict[str, int]]:
    """(regular token id -> the bytes it stands for, byte-fallback ids among them, special token text -> id).

    Special tokens (control tokens such as <eos>, <|im_start|>) are left out of the byte table: they stand for
    no text."""
    kinds = decoder_kinds(tokenizer)
    special: dict[str, int] = {}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in added.items():
        if getattr(token, "special", False) or token_id in special_ids:
            special[str(token)] = token_id
    special_ids |= set(special.values())
    table: dict[int, bytes] = {}
    fallback: set[int] = set()
    for piece, token_id in tokenizer.get_vocab().items():
        if token_id in special_ids:
            continue
        if token_id in added:  # a non-special added token is literal text
            table[token_id] = str(added[token_id]).encode("utf-8")
            continue
        if "byte_fallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            table[token_id] = bytes([int(piece[3:5], 16)])
            fallback.add(token_id)
        elif "byte_level" in kinds and all(c in _BYTE_LEVEL_DECODE for c in piece):
            table[token_id] = bytes(_BYTE_LEVEL_DECODE[c] for c in piece)
        elif "metaspace" in kinds:
            table[token_id] = piece.replace(_METASPACE, " ").encode("utf-8")
        else:
            table[token_id] = piece.encode("utf-8")
    return table, fallback, special
