"""Pure @triton.jit kernels (no validation, no torch glue); launchers live in int8attn.ops."""
