"""A small byte-level BPE trainer, for the built-in vocabulary of synthetic models.

Counts pre-tokenized words once, then merges the most frequent adjacent pair repeatedly,
updating pair counts only for the words a merge touches. Ties break on the pair itself, so
the result is deterministic.
"""
from __future__ import annotations

import heapq
from collections import Counter, defaultdict

import regex

from .pretokenize import QWEN35_SPLIT  # the built-in vocabulary is a qwen35 one


def train_byte_bpe(text: str, n_merges: int) -> list[str]:
    """Up to `n_merges` merges ("a b", best first) learned from `text`."""
    from .vocab import bytes_to_unicode
    b2u = bytes_to_unicode()
    counts = Counter(regex.findall(QWEN35_SPLIT, text))
    words = [[b2u[b] for b in w.encode("utf-8")] for w in counts]
    freq = list(counts.values())
    pairs: Counter = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pairs[p] += freq[i]
            where[p].add(i)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    merges: list[str] = []
    while heap and len(merges) < n_merges:
        negc, p = heapq.heappop(heap)
        if pairs.get(p, 0) != -negc:      # stale entry
            continue
        if -negc < 2:
            break
        merges.append(f"{p[0]} {p[1]}")
        joined = p[0] + p[1]
        touched: set[tuple[str, str]] = set()
        for i in list(where.pop(p, ())):
            w, f = words[i], freq[i]
            for q in zip(w, w[1:]):
                pairs[q] -= f
                touched.add(q)
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == p[0] and w[j + 1] == p[1]:
                    out.append(joined)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for q in zip(out, out[1:]):
                pairs[q] += f
                where[q].add(i)
                touched.add(q)
        pairs.pop(p, None)
        for q in touched:
            c = pairs.get(q, 0)
            if c > 0:
                heapq.heappush(heap, (-c, q))
            else:
                pairs.pop(q, None)
    return merges
