"""GGUF files served directly: a file (or split set) opened as a checkpoint folder whose config, tokenizer and
chat template are derived from its metadata, its tensors read from the file itself (docs/gguf.md)."""
