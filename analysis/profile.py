"""A measured decode-step profile (``moetrace report --profile``): the step time and the share of it each component
takes, parsed with explicit units. Pure functions on plain data.

Units, in the text form ``step=12.1ms,allreduce=51.5%,moe=0.111,attention=15.3%,other=13.4%`` and in JSON alike
(a JSON number reads as a bare number, a JSON string as text):

- shares (allreduce, moe, attention, other): ``N%`` or a bare fraction in [0, 1]; together at most 100%;
- growth per extra token (attention_growth, other_growth): the same, per token, in [0, 1];
- step: a positive time with ``ms``, ``us``/``µs`` or ``s``; a bare number is ms;
- tokens: a positive whole number, no unit: the profile is one request's step of that many tokens (a verification
  window of tokens − 1 drafts; 1: a plain decode step).

Anything else is a one-line ``ValueError`` naming the key, the value and what is accepted: a bare number above 1 is
never read as a percentage.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Profile:
    """A measured decode-step breakdown (shares of ``step_ms``, fractions) at ``tokens`` tokens per step; growth per
    token is the fraction of its component's time one more token in the step adds."""

    step_ms: float
    allreduce: float
    moe: float
    attention: float
    other_gemm: float
    tokens: int = 1
    attention_growth_per_token: float = 0.03  # decode attention: KV read once, compute × T; small
    other_growth_per_token: float = 0.01  # dense GEMMs at T ≤ 64 are weight-read bound: nearly flat
    source: str = "given"

    @property
    def rest(self) -> float:
        return 1.0 - self.allreduce - self.moe - self.attention - self.other_gemm

    def check(self) -> None:
        shares = (self.allreduce, self.moe, self.attention, self.other_gemm)
        growths = (self.attention_growth_per_token, self.other_growth_per_token)
        if not (math.isfinite(self.step_ms) and self.step_ms > 0) or self.rest < -SUM_TOLERANCE \
                or not all(math.isfinite(s) and 0.0 <= s <= 1.0 for s in (*shares, *growths)):
            raise ValueError("profile needs a positive step time, shares in [0, 1] that sum to at most 100% and "
                             "growth per token in [0, 1]")
        if self.tokens < 1:
            raise ValueError("profile tokens must be at least 1")


PROFILE_PRESETS: dict[str, Profile] = {
    "kimi-k2-tp8": Profile(step_ms=12.1, allreduce=0.515, moe=0.111, attention=0.153, other_gemm=0.134,
                           source="measured: Kimi-K2.5 INT4 experts, vLLM TP=8, one decode step"),
}

SUM_TOLERANCE = 1e-9  # shares given to a rounded percent may sum to 100% plus a rounding error
SHARES = ("allreduce", "moe", "attention", "other_gemm")
GROWTHS = ("attention_growth_per_token", "other_growth_per_token")
REQUIRED = ("step_ms", *SHARES)

_KEYS = {"step": "step_ms", "step_ms": "step_ms", "allreduce": "allreduce", "all-reduce": "allreduce",
         "all_reduce": "allreduce", "moe": "moe", "attention": "attention", "other": "other_gemm",
         "other_gemm": "other_gemm", "other-gemm": "other_gemm", "tokens": "tokens",
         "attention_growth": "attention_growth_per_token", "attention_growth_per_token": "attention_growth_per_token",
         "other_growth": "other_growth_per_token", "other_growth_per_token": "other_growth_per_token"}
KNOWN_KEYS = "step, allreduce, moe, attention, other, tokens, attention_growth, other_growth"

ACCEPTED = {
    "share": "a share is a fraction in [0, 1] or a percentage like 1.5%",
    "growth": "growth per extra token is a fraction in [0, 1] or a percentage like 3%",
    "step": "step is a positive time like 12.1ms, 12100us or 0.0121s (a bare number is ms)",
    "tokens": "tokens is a positive whole number with no unit, like 1",
}
_TEXT = re.compile(r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*(%|ms|us|µs|μs|s)?\s*",
                   re.IGNORECASE)
_WHOLE = re.compile(r"\s*([0-9]+)\s*")


def _kind(name: str) -> str:
    if name in SHARES:
        return "share"
    if name in GROWTHS:
        return "growth"
    return "step" if name == "step_ms" else "tokens"


def _shown(value: object) -> str:
    return value.strip() if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=repr)


def _value(name: str, key: str, value: object) -> float | int:
    """One profile value of field ``name`` (given as ``key``): a JSON number reads as a bare number, a string as
    text with its unit."""
    kind = _kind(name)

    def bad() -> ValueError:
        return ValueError(f"profile {key}={_shown(value)}: {ACCEPTED[kind]}")

    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad()
    if kind == "tokens":
        whole = _WHOLE.fullmatch(value) if isinstance(value, str) else None
        tokens = int(whole.group(1)) if whole else value if isinstance(value, int) else 0  # JSON 1.0: not whole
        if tokens < 1:
            raise bad()
        return tokens
    unit: str | None = None
    if isinstance(value, str):
        match = _TEXT.fullmatch(value)
        if not match:
            raise bad()
        number, unit = float(match.group(1)), (match.group(2) or "").lower() or None
    else:
        try:
            number = float(value)
        except OverflowError:
            raise bad() from None
    if not math.isfinite(number):
        raise bad()
    if kind == "step":
        if unit not in (None, "ms", "us", "µs", "μs", "s") or number <= 0:
            raise bad()
        if unit == "s":
            return number * 1e3
        return number / 1e3 if unit in ("us", "µs", "μs") else number  # / 1e3: 12100us is 12.1 exactly
    if unit not in (None, "%"):
        raise bad()
    fraction = number / 100.0 if unit == "%" else number
    if not 0.0 <= fraction <= 1.0:
        raise bad()
    return fraction


def profile_from_mapping(values: Mapping[str, Any], source: str) -> Profile:
    """A profile from KEY → value (text with units, or numbers as bare values)."""
    fields: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in values.items():
        name = _KEYS.get(str(key).strip().lower())
        if name is None:
            raise ValueError(f"profile: unknown key {str(key)!r} (known: {KNOWN_KEYS})")
        if name in fields:
            raise ValueError(f"profile: {given[name]!r} and {str(key)!r} both give {name}")
        given[name] = str(key).strip()
        fields[name] = _value(name, given[name], value)
    missing = [name for name in REQUIRED if name not in fields]
    if missing:
        raise ValueError(f"profile: missing {', '.join(missing)} (give step, allreduce, moe, attention and other)")
    total = sum(fields[name] for name in SHARES)
    if total > 1.0 + SUM_TOLERANCE:
        raise ValueError(f"profile: shares allreduce+moe+attention+other sum to {100 * total:.6g}%, more than 100% "
                         f"of the step")
    profile = Profile(**fields, source=source)
    profile.check()
    return profile


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = next((key for key in keys if keys.count(key) > 1), None)
    if repeated is not None:
        raise ValueError(f"profile: key {repeated!r} given twice")
    return dict(pairs)


def parse_profile(text: str) -> Profile:
    """A preset name, a JSON object, or ``step=12.1ms,allreduce=51.5%,moe=0.111,attention=15.3%,other=13.4%``."""
    stripped = text.strip()
    if stripped in PROFILE_PRESETS:
        return PROFILE_PRESETS[stripped]
    if stripped.startswith("{"):
        try:
            values = json.loads(stripped, object_pairs_hook=_no_repeats)
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile: bad JSON ({exc.msg})") from None
        if not isinstance(values, dict):
            raise ValueError("profile: JSON must be an object")
        return profile_from_mapping(values, "given")
    pairs: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in stripped.split(","))):
        if "=" not in part:
            raise ValueError(f"profile: {part!r} is not KEY=VALUE (presets: {', '.join(PROFILE_PRESETS)})")
        key, value = (s.strip() for s in part.split("=", 1))
        if key in pairs:
            raise ValueError(f"profile: key {key!r} given twice")
        pairs[key] = value
    return profile_from_mapping(pairs, text)
