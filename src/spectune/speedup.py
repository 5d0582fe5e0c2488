"""The theory the bench speaks in (Leviathan et al. 2023).

With per-token acceptance α and draft length k, a verify step yields τ(k) = (1 − α^(k+1)) / (1 − α) tokens on
average. One step costs r(k+1) target steps for verification plus k draft steps of c each, so the speedup over
plain decoding is S(k) = τ(k) / (r(k+1) + k·c). On a memory-bound GPU r ≈ 1 and S = τ / (1 + k·c).
"""

from __future__ import annotations

from collections.abc import Mapping

GPU_VERIFY_RATIO = 1.0  # memory-bound decoding: k+1 tokens cost what one does
MAX_DRAFT_LEN = 8  # the longest k the acceptance meter considers
DEFAULT_DRAFT_MAX = MAX_DRAFT_LEN  # k where no measured recommendation exists
GPU_PROFILE = "gpu"  # the memory-bound GPU profile, whose best k is each draft's recommended k


def expected_tokens(alpha: float, k: int) -> float:
    """τ(k): expected tokens per verify step with i.i.d. acceptance α and k drafted tokens."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(tau: float, k: int, cost_ratio: float, verify_ratio: float = GPU_VERIFY_RATIO) -> float:
    """S = τ / (r(k+1) + k·c)."""
    return tau / (verify_ratio + k * cost_ratio)


def verify_ratio_at(profile: Mapping[str, float] | None, n: int) -> float:
    """r(n) from a measured profile ({"2": r2, ...}); 1.0 for n = 1 or no profile (the GPU assumption)."""
    if n <= 1 or not profile:
        return 1.0
    known = sorted(int(key) for key in profile)
    return float(profile[str(min(known, key=lambda m: abs(m - n)))])
