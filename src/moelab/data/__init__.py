"""Data (layer 1): from documents to the (seed, step)-keyed batches a run trains on.

- `sources`: domains as documents (the embedded ones and user files); `tokenizer`: bytes or HF tokenizers.
- `store`: the tokenized, content-hashed token store; `remote`: object storage through fsspec.
- `mixture`: phases, held-out splits, the sampler and the mixture log.
"""
