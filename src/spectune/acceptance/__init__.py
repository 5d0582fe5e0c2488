"""The acceptance stage: meter.py (α by position and τ(k) offline, on the HF models), stage.py (its settings, c
from the GGUFs, the recommended k)."""
