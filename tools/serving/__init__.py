"""The OpenAI-compatible server under load: TTFT, TPOT and ITL from streamed token ids."""
