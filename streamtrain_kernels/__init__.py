"""Triton kernels, one op per file, each with a pure-torch reference in reference.py. Imports nothing from engine/:
the kernels are usable and testable on their own (the name is not `kernels`, which is Hugging Face's package of that
name, a transformers dependency)."""
