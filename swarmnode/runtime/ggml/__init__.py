"""GGUF weights served as they are: the file's reader, ggml's block formats, the kernels that multiply them."""
