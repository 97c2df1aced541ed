"""GPU kernels. Each file holds the kernel, its XLA reference, and a __main__ that checks and times one case."""
