"""Export: HF models to GGUF with llama.cpp's own converter, quantization through libllama, pair checks."""
