"""`spectune run`: config.py (the run config), stages.py (the stage table), run.py (the runner and its manifest)."""
