"""The machine around the library: malloc, host BLAS threads, checkpoint I/O, and the path of
one command through the code."""
