"""Patching a model: sparsify / unsparsify, the patched Gated-MLP, the state a patched model carries."""
