"""Text to tokens and tokens to batches: documents, tokenizers, `meshtrain prepare`, token files,
built-in corpora and sampling.
"""
