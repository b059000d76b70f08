"""Bridges to the outside: Hugging Face models and tokenizers, and real text turned into tokens."""
