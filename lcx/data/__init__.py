"""Text data: the public-domain corpus (`corpus`) and the byte-level BPE tokenizer (`tokenizer`)."""

from .corpus import SPLITS, VALIDATION_WORKS, Document, clean_gutenberg, load_corpus
from .tokenizer import encode_documents, train_tokenizer

__all__ = ["Document", "SPLITS", "VALIDATION_WORKS", "clean_gutenberg", "encode_documents", "load_corpus",
           "train_tokenizer"]
