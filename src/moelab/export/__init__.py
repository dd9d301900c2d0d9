"""Exports of finished runs (layer 4).

- `writer`: safetensors weights, config.json, tokenizer and README, written whole.
- `llama`: the tensor names every Llama-style `transformers` class shares; `glm4_moe`: the default recipe
  as `Glm4MoeForCausalLM`.
- `check`: an export loaded by `transformers` against the run it came from.
"""
"""Exports of finished runs: safetensors weights, config.json, tokenizer and README (`moelab.export.writer`)."""
