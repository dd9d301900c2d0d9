"""`moelab import` of a synthetic Mixtral checkpoint of a few GB onto 8 simulated devices: wall time and memory.

    python benchmarks/import_stream.py --json                 # ~2 GB, 8 shards, --mesh expert=8
    python benchmarks/import_stream.py --gb 0.5 --json

The checkpoint is written here with random float32 weights under Mixtral's tensor names (config.json, sharded
safetensors and their index; no `transformers` needed), then imported in a child process started with
`--xla_force_host_platform_device_count=8` on the mesh replica=1 x expert=8 with `mesh.shard: full`
(experts over "expert", the rest split over the rack too). Reported: the checkpoint's bytes, its
largest tensor, the import's wall time, the child's peak RSS (`ru_maxrss`) and the peak of Python-side
allocations while the tensors are read and placed (`tracemalloc`: the host staging, numpy included).

On simulated CPU devices the devices' buffers are this process's memory too, so the RSS holds the whole
sharded state (weights, and Adam's two moments the checkpoint saves): it cannot show that no host holds the
model. The host staging figure is the one the streaming bounds: one tensor at a time, read and sent to its
shards, so it stays near the largest tensor's size, whatever the model's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, resource, sys, time, tracemalloc
from pathlib import Path
from moelab.config import MeshConfig
from moelab.export import hf_import

folder, out = Path(sys.argv[1]), Path(sys.argv[2])
staging = {"peak": 0}
read = hf_import.read_weights

def traced(*args, **kwargs):
    tracemalloc.start()
    try:
        return read(*args, **kwargs)
    finally:
        staging["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()

hf_import.read_weights = traced
start = time.perf_counter()
summary = hf_import.import_checkpoint(folder, out, mesh=MeshConfig(replica=1, expert=8, shard="full"))
seconds = time.perf_counter() - start
print(json.dumps({"import_seconds": round(seconds, 1), "host_staging_peak_bytes": staging["peak"],
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "params": summary["params"], "tensors_read": summary["tensors_read"]}))
"""


def write_checkpoint(folder: Path, gb: float, shards: int = 8) -> dict:
    """A Mixtral checkpoint of about `gb` GB: d 1024, 8 heads over 4, 8 experts top-2, enough layers of width 2816."""
    from safetensors.numpy import save_file

    d, width, experts, vocab = 1024, 2816, 8, 32000
    per_layer = 4 * 4 * d * d // 4 + experts * 3 * d * width * 4 + d * experts * 4
    layers = max(1, int((gb * 1e9 - 2 * vocab * d * 4) // per_layer))
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab, "hidden_size": d,
              "intermediate_size": width, "num_hidden_layers": layers, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 128, "num_local_experts": experts, "num_experts_per_tok": 2,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
              "tie_word_embeddings": False, "hidden_act": "silu"}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (d // 2, d),
                       p + "self_attn.v_proj.weight": (d // 2, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "block_sparse_moe.gate.weight": (experts, d)})
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({q + "w1.weight": (width, d), q + "w3.weight": (width, d), q + "w2.weight": (d, width)})
    names = list(shapes)
    weight_map, total = {}, 0
    for s, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {names[j]: (0.02 * rng.standard_normal(shapes[names[j]], dtype=np.float32)) for j in part}
        save_file(tensors, str(folder / file))
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({name: file for name in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    largest = max(int(np.prod(s)) * 4 for s in shapes.values())
    return {"layers": layers, "checkpoint_bytes": total, "largest_tensor_bytes": largest, "tensors": len(names)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="the synthetic checkpoint's size in GB (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not args.gb > 0:
        print(f"Error: --gb={args.gb} must be > 0.", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        made = write_checkpoint(Path(tmp) / "hf", args.gb)
        write_s = time.perf_counter() - started
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()}
        done = subprocess.run([sys.executable, "-c", CHILD, str(Path(tmp) / "hf"), str(Path(tmp) / "run")],
                              capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            sys.exit(1)
        result = {"benchmark": "import_stream", "mesh": "replica=1,expert=8, shard=full (simulated CPU devices)", **made,
                  "write_seconds": round(write_s, 1), **json.loads(done.stdout.strip().splitlines()[-1])}
    result["host_staging_over_largest_tensor"] = round(result["host_staging_peak_bytes"] / result["largest_tensor_bytes"], 2)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['checkpoint_bytes'] / 1e9:.2f} GB in {result['tensors']} tensors imported onto 8 devices in "
          f"{result['import_seconds']} s; host staging peak {result['host_staging_peak_bytes'] / 1e6:.0f} MB "
          f"({result['host_staging_over_largest_tensor']}x the largest tensor), process peak RSS "
          f"{result['peak_rss_bytes'] / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
