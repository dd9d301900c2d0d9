"""moelab: train Mixture-of-Experts language models the way an open lab does (docs/architecture.md).

Layers, low to high; a module imports its own layer or lower ones only (tests/test_layers.py):

0. `errors`, `files`, `config`, `presets`, `accounting`: what a run is, and files written whole.
1. `data`, `model`: tokens in, logits out.
2. `parallel`: meshes, shardings, expert-parallel dispatch.
3. `train`: one run.
4. `ladder`, `evals`, `export`: what uses finished or running runs.
5. `lab`: experiments.
6. `cli`: the `moelab` command, parsing and printing only.
"""
