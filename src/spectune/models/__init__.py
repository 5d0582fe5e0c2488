"""Models: loading local Hugging Face folders, and the demo world (offline tokenizer and base pairs)."""
