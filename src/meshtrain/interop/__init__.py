"""Bridges to the outside: Hugging Face tokenizers and models, and real text turned into tokens."""
