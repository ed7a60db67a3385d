"""Stage 6, hub: Hugging Face Hub sources (download), Hub error mapping, uploads with model cards and provenance."""
