"""Evaluations of finished runs (layer 4).

- `loss`: loss, perplexity and bits per byte on any data.
- `arithmetic`: the held-out arithmetic exact-match task the ladder predicts.
- `harness`: lm-evaluation-harness tasks through a moelab `LM` adapter.
"""
"""Evaluations of finished runs: loss, perplexity and bits per byte on any data (`moelab.evals.loss`), and
lm-evaluation-harness tasks through a moelab `LM` adapter (`moelab.evals.harness`)."""
