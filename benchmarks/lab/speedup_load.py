"""The load ``bench_speedup_validation.py measure`` runs and ``compare`` reads back: what a round is.

Load: closed loop, the shape of a server. At concurrency C exactly C requests are in flight: C are added to vLLM's
engine (``LLMEngine.add_request``, stepped with ``step``), and each one that ends is replaced by the next until a
round's ``max(8, 3 C)`` requests have all been added. A round's throughput is the output tokens generated while C
were in flight (from the end of the step in which C requests had produced a token up to the first completion that
no request replaces: at least 2 C completions, the fill and the drain left out) over that span's wall time. Greedy,
``ignore_eos``, 192 to 320 tokens each (256 on average, ``LENGTHS``), prefix caching off, every round the same
requests.
"""

from __future__ import annotations

import argparse
import random
import statistics

LOAD = "closed-loop"
PROMPT_CUTS = (1.0, 0.9, 0.8, 0.7, 0.6)  # each built-in prompt cut at these fractions: 50 distinct prompts
# output lengths, as fractions of --max-tokens, request by request: requests in flight end at different steps at
# every k, k = 0 included, as a server's do (with equal lengths, C requests started together at k = 0 would end
# together, which is the benchmark's doing, not speculation's)
LENGTHS = (0.75, 1.125, 0.875, 1.25, 1.0)


def parse_concurrencies(text: str) -> list[int]:
    """``1,4,16`` → [1, 4, 16]: distinct, positive, in the order given."""
    values = list(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be positive integers: {text!r}")
    return values


def requests_per_round(concurrency: int) -> int:
    """Requests of one round at ``concurrency``: eight one after another at 1; 3 C otherwise, so the span in
    which C are in flight covers at least 2 C completions."""
    return max(8, 3 * concurrency)


def distinct_prompts(length: int | None = None) -> list[str]:
    """The built-in prompts and shorter cuts of them (at a space), all distinct, so no two requests of a step route
    alike because they are the same text; with ``length``, each repeated to ``length`` characters (a Kimi-K2
    slice's tokens: it reads bytes), so the context a request decodes at is the prompt length asked for, numbered
    (a cut longer than ``length`` would otherwise repeat to the same text as the whole prompt)."""
    from moetrace.recording.prompts import BUILTIN_PROMPTS

    out: list[str] = []
    for cut in PROMPT_CUTS:
        for prompt in BUILTIN_PROMPTS:
            end = len(prompt) if cut == 1.0 else prompt.rfind(" ", 0, int(len(prompt) * cut))
            text = prompt[: max(end, 1)]
            out.append(text if length is None else
                       (f"{len(out)}. " + (text + "\n") * (length // (len(text) + 1) + 1))[:length])
    if len(set(out)) != len(out):
        raise RuntimeError("prompt cuts are not distinct")
    return out


def model_len(prompt_tokens: int | None, max_tokens: int) -> int:
    """The engine's max_model_len for a slice: 1,024, or room for ``prompt_tokens`` and the output."""
    return max(1024, (prompt_tokens or 0) + max_tokens + 16)


def output_lengths(count: int, max_tokens: int, lengths: tuple[float, ...] = LENGTHS) -> list[int]:
    """Tokens each of ``count`` requests generates (``lengths`` in turn, fractions of ``max_tokens``)."""
    return [round(max_tokens * lengths[i % len(lengths)]) for i in range(count)]


def span_prefill_share(concurrency: int, lengths: list[int], gains: list[int], seeds: int = 20) -> float:
    """Prefills per output token inside ``closed_loop``'s span at ``concurrency``, over those of its whole round
    (``lengths``: the tokens each request of the round produces; ``gains``: the tokens a request gains per decode
    step, one drawn at random each step; [1] at k = 0). The span opens on the fill's requests all fresh, so none
    ends in its first min(lengths) steps: it holds n − C prefills over more tokens than a server's steady state,
    for which a round's n prefills over its Σ lengths stand (and a trace's prefill, pooled over whole rounds).
    Simulated step by step, a finished request replaced by the next, whose prefill step gives its first token; the
    mean over ``seeds`` draws of the gains."""
    count = len(lengths)
    if count <= concurrency:
        raise ValueError(f"a round of {count} requests has no span at concurrency {concurrency}")
    shares = []
    for seed in range(seeds if len(set(gains)) > 1 else 1):
        draw = random.Random(seed).choice
        running = {index: 1 for index in range(concurrency)}  # request → tokens it has: the fill's first token
        added, ended, tokens = concurrency, 0, 0
        while ended < count - concurrency + 1:  # the span closes at the first completion nobody replaces
            for index, have in list(running.items()):
                gained = min(draw(gains), lengths[index] - have)
                running[index], tokens = have + gained, tokens + gained
            for index in [i for i, have in running.items() if have >= lengths[i]]:
                del running[index]
                ended += 1
                if added < count:
                    running[added], added = 1, added + 1
        shares.append((count - concurrency) / tokens / (count / sum(lengths)))
    return statistics.fmean(shares)


def round_order(round_index: int, concurrencies: list[int]) -> list[int]:
    """The concurrencies of one round in the order they run: alternating, so none always runs first."""
    return concurrencies if round_index % 2 == 0 else concurrencies[::-1]
