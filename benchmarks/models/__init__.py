"""Whole models: Chronos-Bolt forwards against PyTorch and the machine's GEMM rate, decoding,
train steps, sparse binary transformers."""
