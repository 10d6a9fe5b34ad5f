"""Calibration and evaluation texts: licence files present on every Debian machine.

Evaluation (held out): the first 4096 tokens of /usr/share/common-licenses/GPL-3.
Calibration: the other licence files in that folder, in CALIBRATION_FILES order, with every
paragraph that shares any 8-word sequence with GPL-3 (anywhere in it) removed, so that the FSF
licences, which reuse sentences of GPL-3's preamble and appendix, cannot leak evaluation text
into calibration. Symlinks (GPL, LGPL, GFDL point at their newest version) are not read twice.

    texts = calibration_texts()            # list of strings, one per document
    eval_ids = evaluation_tokens(tok)      # 4096 token ids of GPL-3
"""

from __future__ import annotations

import os
import re

LICENSES = "/usr/share/common-licenses"
EVAL_FILE = "GPL-3"
EVAL_TOKENS = 4096
CALIBRATION_FILES = [
    "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic", "CC0-1.0", "MPL-1.1", "GPL-2",
    "LGPL-2.1", "GFDL-1.2", "GPL-1", "LGPL-2", "LGPL-3", "BSD",
]
SHINGLE = 8


def _read(name: str) -> str:
    with open(os.path.join(LICENSES, name), encoding="utf-8") as f:
        return f.read()


def _words(text: str) -> list:
    return re.findall(r"[a-z0-9]+", text.lower())


def _shingles(words: list) -> set:
    return {tuple(words[i:i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def eval_text() -> str:
    return _read(EVAL_FILE)


def _paragraphs(text: str) -> list:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def calibration_texts() -> list:
    """The calibration documents, each with GPL-3-overlapping paragraphs removed."""
    held_out = _shingles(_words(eval_text()))
    docs = []
    for name in CALIBRATION_FILES:
        keep = [p for p in _paragraphs(_read(name)) if not (_shingles(_words(p)) & held_out)]
        docs.append("\n\n".join(keep) + "\n")
    return docs


def evaluation_tokens(tokenizer, n: int = EVAL_TOKENS) -> list:
    ids = tokenizer.encode(eval_text())
    if len(ids) < n:
        raise ValueError(f"{EVAL_FILE} has only {len(ids)} tokens")
    return ids[:n]


def calibration_sequences(tokenizer, total_tokens: int, seq_len: int) -> list:
    """Token sequences of at most `seq_len` tokens, in document order, `total_tokens` in all.

    Each document is cut into whole sequences; a remainder shorter than seq_len/4 is dropped.
    """
    seqs = []
    left = total_tokens
    for doc in calibration_texts():
        ids = tokenizer.encode(doc)
        for start in range(0, len(ids), seq_len):
            chunk = ids[start:start + seq_len]
            if len(chunk) < seq_len // 4:
                break
            chunk = chunk[:left]
            seqs.append(chunk)
            left -= len(chunk)
            if left <= 0:
                return seqs
    return seqs
