"""Text in and out: the `tokenizers` backend with chat templates rendered as `transformers` renders
them (`tokenizer`), and incremental decoding of generated tokens with stop strings
(`detokenize`)."""
