"""Checkpoints: layout-independent save and load, verification before use, retention, resume rules,
and whole-model files.
"""
