"""Stage 3, write: output shards from a plan, JSON side files, atomic output directories, fsync, the output lock."""
