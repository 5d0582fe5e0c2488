"""`python -m spectune.cli`, e.g. under `accelerate launch -m`."""

from spectune.cli import main

main()
