"""Data: the corpus, the tokenizer, packing into fixed-length sequences, the held-out split, prefetching.

Main entry: `load_token_dataset(config.data, vocab_size, seq_len, run_dir) -> (TokenDataset, tokenizer)`.
"""

from dropless.data.corpus import Corpus, DataError, DataWarning, load_token_array, resolve, stdlib_files
from dropless.data.loader import (TOKENIZER_FILE, TokenDataset, TokenStream, document_order, load_token_dataset,
                                  load_token_stream, reorder, resolve_eos_id, split_point)
from dropless.data.prefetch import Prefetcher
from dropless.data.tokenizer import EOS_TOKEN, TextTokenizer, load_tokenizer, read_tokenizer_file, train_bpe

__all__ = ["Corpus", "DataError", "DataWarning", "EOS_TOKEN", "Prefetcher", "TOKENIZER_FILE", "TextTokenizer",
           "TokenDataset", "TokenStream", "document_order", "load_token_array", "load_token_dataset",
           "load_token_stream", "load_tokenizer", "read_tokenizer_file", "reorder", "resolve", "resolve_eos_id",
           "split_point", "stdlib_files", "train_bpe"]
