"""Llama 3 RoPE scaling from a GGUF file's ``rope_freqs.weight``: the parameters that give its factors.

llama.cpp's converter stores Llama 3.x's frequency scaling (transformers' rope type "llama3", Meta's
``apply_scaling`` in the Llama 3.1 reference code) not as parameters but as the resulting factor per rotary
frequency: ``rope_freqs.weight`` [D / 2] float32, the wavelength of frequency i (inv_freq_i = theta^(-2i / D))
divided by that factor. With wavelength w = 2 pi / inv_freq and parameters (factor f, low_freq_factor l,
high_freq_factor h, original context n):

  factor_i = 1                                  when w < n / h            (high frequencies: unscaled)
           = f                                  when w > n / l            (low frequencies: slowed f times)
           = 1 / ((1 - s) / f + s), s = (n / w - l) / (h - l)   in between

Every (l, h, n) with the same n / (h - l) and l / (h - l) gives the same factors, so the parameters are
recovered with l = 1 (Meta's value in every Llama 3.x release): f is the largest factor; from two or more
factors strictly between 1 and f, s is linear in 1 / w and its two coefficients give h and n; with fewer, h = 4
(Meta's value) and n is the first power of two that reproduces the factors. Either way the recovered
parameters are accepted only when the factors computed from them equal the file's (relative 1e-5: the
converter computes them partly in float32), so the model built from them computes the same rotation.
"""

from __future__ import annotations

import math

import numpy as np

TOLERANCE = 1e-5


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """The factor per rotary frequency [head_dim / 2] float64 of the llama3 parameters (module docstring)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))


def _matches(factors: np.ndarray, head_dim: int, theta: float, params: tuple) -> bool:
    got = llama3_factors(head_dim, theta, *params)
    return bool(np.all(np.abs(got - factors) <= TOLERANCE * np.abs(factors)))


def llama3_rope_scaling(factors, head_dim: int, theta: float) -> dict | None:
    """The transformers rope_scaling {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"} whose factors equal ``factors`` ([head_dim / 2] floats); None when every
    factor is 1 (no scaling). Raises ValueError (the caller names the tensor) for factors of another length,
    non-finite or below 1, or factors no llama3 parameters with low_freq_factor 1 reproduce."""
    factors = np.asarray(factors, np.float64).reshape(-1)
    if factors.size != head_dim // 2 or not np.all(np.isfinite(factors)) or np.any(factors < 1 - TOLERANCE):
        raise ValueError(f"{factors.size} factors; Llama 3 scaling has head_dim / 2 = {head_dim // 2} factors "
                         "in [1, factor]")
    f = float(factors.max())
    if f <= 1 + TOLERANCE:
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    between = (factors > 1 + TOLERANCE) & (factors < f * (1 - TOLERANCE))
    candidates = []
    if between.sum() >= 2:
        s = (1 / factors[between] - 1 / f) / (1 - 1 / f)          # s = A / w - B, A = n / (h - 1), B = 1 / (h - 1)
        A, minus_B = np.polyfit(1 / wavelen[between], s, 1)
        if -minus_B > 0:
            high = 1 - 1 / minus_B
            candidates.append((f, 1.0, float(round(high, 6)), float(round(A * (high - 1)))))
    candidates += [(f, 1.0, 4.0, float(2 ** k)) for k in range(41)]
    for params in candidates:
        if _matches(factors, head_dim, theta, params):
            f_, low, high, original = params
            return {"rope_type": "llama3", "factor": f_, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": int(original)}
    raise ValueError("no Llama 3 scaling parameters (low_freq_factor 1) reproduce these factors")
