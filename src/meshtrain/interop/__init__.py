"""Interoperability with other ecosystems: Hugging Face models and tokenizers, dataset files."""
