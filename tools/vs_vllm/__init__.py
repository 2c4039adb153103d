"""vLLM against Rimuru on the same streams: vLLM's replay (runs where vLLM is carried) and the merged table."""
