"""Tensor-parallel schemes: the layer factories models are built from (Megatron 1D, SUMMA 2D/2.5D,
3D) and their layers.
"""
