"""Offline converter for Gemma 4 target + MTP assistant checkpoints (see README.md)."""

__version__ = "0.1.0"
