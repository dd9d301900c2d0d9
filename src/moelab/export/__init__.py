"""Exports of finished runs: safetensors weights, config.json, tokenizer and README (`moelab.export.writer`)."""
