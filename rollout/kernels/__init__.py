"""The CPU kernels behind the ops seam: C sources compiled on first use, their ctypes bindings and torch fallbacks."""
