"""Stage 1, read: safetensors headers, checkpoints (config + shards + index), byte ranges and sequential reads."""
