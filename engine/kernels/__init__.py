"""Triton kernels, one op per file, each with a pure-torch reference in engine/kernels/reference.py."""
