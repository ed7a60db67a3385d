"""Factories for tests, the demo and scripts: synthetic Gemma 4 checkpoints; the product never imports this."""
