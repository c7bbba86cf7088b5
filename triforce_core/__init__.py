"""triforce: lossless hierarchical speculative decoding for long-context language models."""
__version__ = "0.1.0"
