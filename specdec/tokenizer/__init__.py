"""Tokenizers: xtok `tokenizer.tok.json`, tiktoken files (`*.tiktoken`, Llama-3 `tokenizer.model`) and HF
byte-level BPE `tokenizer.json`, all run by tiktoken; chat templates; streaming detokenization."""

from specdec.tokenizer.detokenizer import IncrementalDetokenizer
from specdec.tokenizer.load import load_tokenizer
from specdec.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]
