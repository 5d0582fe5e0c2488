"""Runtime: llama.cpp models and the speculative draft -> verify loop."""
