"""Speculative decoding: a cheap proposer drafts up to k tokens per row, the target model scores
them all in one forward, and the rejection sampler keeps the longest prefix the target agrees
with plus one token of its own.

* ``engine.spec_decode.rejection_sampler`` -- ``rejection_sample``: the batched verifier
  (defines the vocabulary: draft / target / accepted / recovered / bonus).
* ``engine.spec_decode.metrics`` -- ``SpecDecodeStats``: drafts, draft tokens, accepted tokens,
  acceptance per position.

Kept light: importing this package imports neither torch nor the model; import the submodules.
"""
