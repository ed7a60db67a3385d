"""Stage 5, advice: what `inspect` reports and predicts (layers, schemes, serving environments, vLLM weight loading)."""
