"""Least-squares fits for calibration curves: plain Python (no numpy, no torch), so they run anywhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Solve a small square linear system by Gaussian elimination with partial pivoting."""
    n = len(rhs)
    a = [row[:] + [value] for row, value in zip(matrix, rhs)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            raise ValueError("singular system: the points do not determine every coefficient")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= factor * a[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out


def least_squares(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Coefficients c minimising ||sum_j c_j·columns[j] − y||² (normal equations; columns are few and scaled)."""
    if not y:
        raise ValueError("no points to fit")
    if len(y) < len(columns):
        raise ValueError(f"{len(y)} points cannot fit {len(columns)} coefficients")
    scale = [max(abs(v) for v in col) or 1.0 for col in columns]
    cols = [[v / s for v in col] for col, s in zip(columns, scale)]
    gram = [[sum(a * b for a, b in zip(ci, cj)) for cj in cols] for ci in cols]
    rhs = [sum(a * b for a, b in zip(ci, y)) for ci in cols]
    return [c / s for c, s in zip(solve(gram, rhs), scale)]


def fit_quality(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """R² and the largest relative error of a fit."""
    mean = sum(measured) / len(measured)
    total = sum((m - mean) ** 2 for m in measured)
    residual = sum((p - m) ** 2 for p, m in zip(predicted, measured))
    return {
        "r2": 1.0 - residual / total if total > 0 else 1.0,
        "max_rel_err": max(abs(p - m) / m for p, m in zip(predicted, measured) if m > 0) if measured else 0.0,
    }


def fit_expert_time(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Fit ``time_us = c0_us + per_expert_us·experts + per_row_us·rows`` over measured points."""
    experts = [float(p["experts"]) for p in points]
    rows = [float(p["rows"]) for p in points]
    y = [float(p["time_us"]) for p in points]
    c0, per_expert, per_row = least_squares([[1.0] * len(y), experts, rows], y)
    predicted = [c0 + per_expert * e + per_row * r for e, r in zip(experts, rows)]
    return {
        "model": "c0_us + per_expert_us*experts + per_row_us*rows",
        "c0_us": c0,
        "per_expert_us": per_expert,
        "per_row_us": per_row,
        "points": len(y),
        **fit_quality(predicted, y),
    }


def fit_allreduce(points: Sequence[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """Fit ``time_us = latency_us + 2(N−1)/N · bytes / bus_bandwidth`` (ring all-reduce) over measured points."""
    size = [float(p["bytes"]) for p in points]
    y = [float(p["time_us"]) for p in points]
    latency, per_byte = least_squares([[1.0] * len(y), size], y)
    ring = 2.0 * (world_size - 1) / world_size
    predicted = [latency + per_byte * s for s in size]
    return {
        "model": "latency_us + 2(N-1)/N * bytes / bus_bandwidth",
        "latency_us": latency,
        "us_per_byte": per_byte,
        # GB/s = bytes / (µs · 1e3); bus bandwidth counts the ring's 2(N−1)/N traffic per byte of message
        "bus_bandwidth_gbs": ring / (per_byte * 1e3) if per_byte > 0 else None,
        "points": len(y),
        **fit_quality(predicted, y),
    }
