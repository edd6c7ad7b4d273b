"""A decode as a stream: the token ids each target pass commits, as soon as they are committed (the first chunk is
the plain prefill's one token); speculative_generate and autoregressive_generate collect it.

    for chunk in speculative_stream(target, draft, ids, plan=DraftPlan(4), max_new_tokens=128):
        print(tokenizer.decode(chunk), end="", flush=True)
"""
from __future__ import annotations

import torch

from pipeline.decoding.loop import DecodeStats, GenerationOutput


class TokenStream:
    """Iterates over lists of token ids, one per target pass; `stats` is complete once the stream is
    exhausted or closed. Decoding happens while it is iterated: a stream nobody reads costs nothing more."""

    def __init__(self, chunks, stats: DecodeStats):
        self._chunks, self.stats = chunks, stats

    def __iter__(self):
        for chunk in self._chunks:
            yield chunk if isinstance(chunk, list) else chunk.tolist()  # plain decoding's token: one host read

    def close(self) -> None:
        """Stops decoding early (the stats then cover what was committed)."""
        self._chunks.close()

    def collect(self) -> GenerationOutput:
        """Every chunk, concatenated: what the generate functions return. Plain decoding's tokens stay on the
        device until the end (no per-token host sync unless an EOS is checked)."""
        chunks = list(self._chunks)  # all lists, or (plain decoding without an EOS) all device tensors
        if chunks and not isinstance(chunks[0], list):
            return GenerationOutput(torch.cat(chunks).cpu(), self.stats)
        return GenerationOutput(torch.tensor([t for chunk in chunks for t in chunk], dtype=torch.long), self.stats)
