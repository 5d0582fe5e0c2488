"""Hand-off to the engines people already run: llama.cpp's own binaries (built from the pinned sources, the same
code the Python binding runs), and the vLLM / SGLang command for the finished run's HF folders."""
