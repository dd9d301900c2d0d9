"""Exports of finished runs, and imports of published checkpoints (layer 4).

- `writer`: safetensors weights, config.json, tokenizer and README, written whole.
- `llama`: the tensor names every Llama-style `transformers` class shares; `glm4_moe`: the default recipe
  as `Glm4MoeForCausalLM`.
- `check`: an export loaded by `transformers` against the run it came from.
- `hf_import`: a Hugging Face Mixtral, Glm4Moe, Qwen3-MoE or OLMoE checkpoint read tensor by tensor into a moelab run.
"""
