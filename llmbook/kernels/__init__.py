"""GPU kernels (Triton), each reached through one function that picks a backend."""
