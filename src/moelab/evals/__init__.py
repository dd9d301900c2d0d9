"""Evaluations of finished runs: loss, perplexity and bits per byte on any data (`moelab.evals.loss`), and
lm-evaluation-harness tasks through a moelab `LM` adapter (`moelab.evals.harness`)."""
