"""Compression methods end to end: quality and speed of pruning, partitioning, irregular
attention, CP-ALS, rank sweeps, pretraining and fine-tuning recipes, Flax interop."""
