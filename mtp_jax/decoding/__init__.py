"""Decoding: the chain and tree loops, sampling, stop sequences, the cost model behind
heads="auto" / tree="auto", and the timing of decoding modes (docs/decoding.md)."""
