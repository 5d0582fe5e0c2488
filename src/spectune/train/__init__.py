"""Training: the target with QLoRA (target.py) and drafts that think like it (draft.py)."""
