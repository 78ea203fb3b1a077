"""SLO pairs as the serving benchmarks take and label them: "TTFT:TPOT" in seconds."""

from __future__ import annotations

import argparse


def slo_list(text: str) -> list[tuple[float, float]]:
    """ "TTFT:TPOT[,TTFT:TPOT...]" in seconds, e.g. "1:0.05,2:0.1"."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            ttft, tpot = (float(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: want TTFT:TPOT in seconds") from None
        if ttft <= 0 or tpot <= 0:
            raise argparse.ArgumentTypeError(f"{part!r}: both must be > 0")
        out.append((ttft, tpot))
    return out


def slo_pair(text: str) -> tuple[float, float]:
    """Exactly one "TTFT:TPOT" pair."""
    pairs = slo_list(text)
    if len(pairs) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want one TTFT:TPOT pair, e.g. 1:0.05")
    return pairs[0]


def slo_label(ttft: float, tpot: float) -> str:
    """The key of a pair in serve.py's output (`goodput_at`, `goodput_sum_rps`)."""
    return f"{ttft:g}:{tpot:g}"
