"""Single layers and leaves: time per FLOP of compressed leaves against the dense one, CPU
chunking of attention and MLPs, other libraries on the same products."""
