"""The model: decoder math, rotary embeddings, shapes, weights and loading, GGUF, named architectures."""
