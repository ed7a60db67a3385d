"""Stage 5, proof: verify a conversion (every tensor accounted for, bytes and transforms, numerics vs a reference)."""
