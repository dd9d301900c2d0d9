"""`moelab import HF_DIR --out RUN_DIR`: a published Mixtral, Glm4Moe, Qwen3-MoE or OLMoE checkpoint as a moelab run.

    summary = import_checkpoint("hf/my-mixtral", "runs/my-mixtral")
    run = load_run("runs/my-mixtral")              # what `moelab generate`, `eval` and `export` read

`config.json` becomes a ModelConfig; each tensor of the (sharded) `*.safetensors` files is read one at a
time (`safetensors.safe_open`: the file is memory-mapped, only the tensor asked for is read), transposed from
torch's [out, in] to moelab's [in, out], and written straight into its shards of the run's state, born
sharded on the run's mesh (`_sharded_params`): no host holds more than the tensor being read.

    MixtralForCausalLM   softmax router, top-k renormalized; block_sparse_moe.experts.e.w1 / w3 / w2
    Glm4MoeForCausalLM   sigmoid router whose e_score_correction_bias (choose, do not weight) seeds moelab's
                         router bias, norm_topk_prob, routed_scaling_factor, n_shared_experts fused into one
                         SwiGLU of width n_shared_experts x moe_intermediate_size; use_qk_norm per head;
                         partial_rotary_factor (model.rope_fraction);
                         n_group / topk_group (model.moe.num_groups / groups_per_token);
                         first_k_dense_replace dense SwiGLU layers of intermediate_size (model.dense_layers)
    Qwen3MoeForCausalLM  softmax router, top-k renormalized or not (norm_topk_prob); QK-norm per head;
                         mlp_only_layers [0, ..., k-1] as model.dense_layers
    OlmoeForCausalLM     softmax router, top-k not renormalized (norm_topk_prob); QK-norm over the projection

A config value moelab does not model is refused by name, never approximated: a sliding window,
dense layers anywhere but first (`mlp_only_layers` other than [0, ..., k-1], `decoder_sparse_step`), `clip_qkv`,
attention biases (but Glm4Moe's, GLM-4.5's `attention_bias`: model.attention_bias), a rope_scaling other than
"default", an activation other than SiLU.
Checkpoints with multi-token-prediction layers (GLM-4.5's `num_nextn_predict_layers`) import without
them: their tensors (layer index >= num_hidden_layers) are left out, and the summary says so.

The run directory holds `config.yaml` (the model as imported; for Glm4Moe, whose bias is a balancing bias,
`balancing: hist`, or `sign` with expert groups; `none` for the others; the embedded default data, and the checkpoint's `tokenizer.json`
when it has one), `checkpoints/0` (the weights, fresh Adam moments, the router bias), `tokenizer.json` and
`imported.json` (the source). It is written under a temporary name and renamed into place when complete:
bad input leaves nothing. `moelab train RUN_DIR/config.yaml --out RUN_DIR` continues from it (any config
that keeps the weights' shapes: another dispatch, mesh, balancing, LR, data or step count), starting at
step 0 from the imported weights and router bias; from its first checkpoint on it resumes as any run.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from moelab import presets
from moelab.config import MeshConfig, ModelConfig, MoEConfig, RunConfig, dump_yaml
from moelab.errors import ConfigError, DataError
from moelab.export.writer import INDEX, WEIGHTS
from moelab.train import outputs
from moelab.train.checkpoint import Checkpointer
from moelab.parallel import mesh as mesh_lib
from moelab.train.state import TrainState, make_optimizer, state_shardings

__all__ = ["ARCHITECTURES", "read_hf_config", "model_config", "tensor_files", "read_weights", "import_checkpoint"]

MAX_SEQ_LEN = 4096  # the imported run's training sequence length: the model's own, up to this


def read_hf_config(folder: Path) -> dict:
    """config.json as a dict; DataError naming the file when it is missing or not a JSON object."""
    path = folder / "config.json"
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path} does not exist: pass a Hugging Face model folder (config.json and "
                        "*.safetensors, as save_pretrained writes them).") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not JSON ({e}); pass the folder save_pretrained wrote.") from None
    if not isinstance(hf, dict):
        raise DataError(f"{path} is not a JSON object; pass the folder save_pretrained wrote.")
    return hf


@dataclass(frozen=True)
class _HFConfig:
    """One architecture's config.json, transformers' defaults filled in and nulls dropped, read field by field:
    each failure is a ConfigError naming the file and the field."""

    values: dict
    path: Path
    arch: str

    def get(self, field: str, default: Any = None) -> Any:
        return self.values.get(field, default)

    def missing(self, field: str) -> ConfigError:
        return ConfigError(f"{self.path}: {field} is missing; a {self.arch} config.json has it.")

    def read(self, field: str, kind: type = int, default: Any = None) -> Any:
        """`field` as `kind`; `default`, when given, stands in for a missing, null or zero value."""
        value = self.values.get(field) if default is None else self.values.get(field) or default
        if value is None:
            raise self.missing(field)
        return self.number(field, value, kind)

    def number(self, field: str, value: Any, kind: type = int) -> Any:
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{self.path}: {field}={value!r} is not a number where one is needed.") from None

    def refuse(self, field: str, value: Any, why: str) -> None:
        raise ConfigError(f"{self.path}: {field}={value!r} is not something moelab models ({why}); it is refused "
                          "rather than approximated.")


def _rope(hf: _HFConfig) -> tuple[float, float]:
    """(rope_theta, the share of each head RoPE rotates)."""
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling"):
        hf.refuse("rope_scaling", hf.get("rope_scaling"), "moelab's RoPE has no scaling")
    if rope.get("rope_type", "default") != "default":
        hf.refuse("rope_parameters.rope_type", rope.get("rope_type"), "moelab's RoPE is the default one")
    factors = {hf.number("partial_rotary_factor", f, float)
               for f in (rope.get("partial_rotary_factor"), hf.get("partial_rotary_factor")) if f is not None}
    if len(factors) > 1:
        hf.refuse("partial_rotary_factor", sorted(factors), "config.json gives two different values")
    theta = (hf.number("rope_parameters.rope_theta", rope["rope_theta"], float) if "rope_theta" in rope
             else hf.read("rope_theta", float))
    return theta, factors.pop() if factors else 1.0


# Each architecture's reader: (its MoEConfig fields but num_experts_per_token, its ModelConfig fields beyond the
# shape every one shares: dense_layers, qk_norm). The shared part is `model_config`'s.

def _mixtral(hf: _HFConfig) -> tuple[dict, dict]:
    """Softmax router, top-k renormalized."""
    return dict(num_experts=hf.read("num_local_experts"), expert_dim=hf.read("intermediate_size"),
                router_score="softmax", normalize_weights=True, balancing="none"), {}


def _glm4_moe(hf: _HFConfig) -> tuple[dict, dict]:
    """Sigmoid router with a choosing bias (moelab's router bias, so a balancing rule keeps it moving), groups,
    shared experts fused into one SwiGLU, dense first blocks, QK-norm per head when use_qk_norm."""
    dense, layers = hf.read("first_k_dense_replace"), hf.read("num_hidden_layers")
    if dense >= layers:
        hf.refuse("first_k_dense_replace", dense, f"with num_hidden_layers={layers} no block is a MoE block; "
                  "moelab trains MoE models")
    width, shared, groups = hf.read("moe_intermediate_size"), hf.read("n_shared_experts"), hf.read("n_group")
    moe = dict(num_experts=hf.read("n_routed_experts"), expert_dim=width, router_score="sigmoid",
               normalize_weights=hf.read("norm_topk_prob", bool), routed_scaling=hf.read("routed_scaling_factor", float),
               num_shared_experts=1 if shared else 0, shared_expert_dim=shared * width if shared else None,
               num_groups=groups, groups_per_token=hf.read("topk_group"),
               # the quantile rules assume plain top-k; within groups, DeepSeek-V3's own sign rule
               balancing="hist" if groups == 1 else "sign")
    return moe, dict(dense_layers=dense, qk_norm="head" if hf.get("use_qk_norm") else None)


def _qwen3_moe(hf: _HFConfig) -> tuple[dict, dict]:
    """Softmax router, top-k renormalized or not; QK-norm per head; mlp_only_layers [0, ..., k-1] as dense first
    blocks."""
    if hf.read("decoder_sparse_step", default=1) != 1:
        hf.refuse("decoder_sparse_step", hf.get("decoder_sparse_step"),
                  "moelab's dense blocks come first (model.dense_layers), not every few layers")
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or dense != list(range(len(dense))):
        hf.refuse("mlp_only_layers", dense, "moelab's dense blocks are the first ones (model.dense_layers): "
                  "[0, 1, ..., k-1]")
    return _softmax_experts(hf, hf.read("moe_intermediate_size")), dict(dense_layers=len(dense), qk_norm="head")


def _olmoe(hf: _HFConfig) -> tuple[dict, dict]:
    """Softmax router, top-k renormalized or not; QK-norm over the whole projection."""
    if hf.get("clip_qkv") is not None:
        hf.refuse("clip_qkv", hf.get("clip_qkv"), "moelab does not clip its projections")
    return _softmax_experts(hf, hf.read("intermediate_size")), dict(qk_norm="full")


def _softmax_experts(hf: _HFConfig, width: int) -> dict:
    """Qwen3-MoE's and OLMoE's experts: a softmax router, renormalized as norm_topk_prob says."""
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if experts is None:
        raise hf.missing("num_experts")
    return dict(num_experts=hf.number("num_experts", experts), expert_dim=width,
                router_score="softmax", normalize_weights=hf.read("norm_topk_prob", bool), balancing="none")


@dataclass(frozen=True)
class _Architecture:
    """How one transformers class's config.json reads into a ModelConfig."""

    read: Callable[[_HFConfig], tuple[dict, dict]]
    defaults: dict
    """What transformers assumes for a key config.json leaves out (its config class's defaults): a missing key
    must read as transformers reads it, not as moelab's own default."""
    window_switch: str | None = None  # None: a sliding_window turns a window on; else this key does (Qwen3-MoE)


_IMPORTS = {
    "MixtralForCausalLM": _Architecture(_mixtral, {"rms_norm_eps": 1e-5, "rope_theta": 1e6}),
    "Glm4MoeForCausalLM": _Architecture(_glm4_moe, {
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "first_k_dense_replace": 1,
        "intermediate_size": 10944, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "n_shared_experts": 1}),
    "Qwen3MoeForCausalLM": _Architecture(_qwen3_moe, {
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "norm_topk_prob": False, "intermediate_size": 6144},
        window_switch="use_sliding_window"),
    "OlmoeForCausalLM": _Architecture(_olmoe, {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "norm_topk_prob": False}),
}
ARCHITECTURES = tuple(_IMPORTS)


def model_config(hf: dict, path: Path) -> tuple[str, ModelConfig]:
    """(architecture, the ModelConfig that computes the same function); ConfigError naming what does not map.

    What every architecture shares is read here (the attention's shape, RoPE, the norms, the refusals); its
    `_IMPORTS` entry reads its experts and dense blocks.
    """
    archs = hf.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if hf.get("format") == "moelab":  # `moelab export` of a model no transformers class computes (LatentMoE)
        raise ConfigError(f"{path}: this is moelab's own export layout, not a transformers checkpoint: load it with "
                          "moelab.export.writer.load_export (its README.md says how), or train on from the run it was "
                          "exported from; `moelab import` reads " + ", ".join(ARCHITECTURES) + ".")
    if arch not in ARCHITECTURES:  # a tuple: an unhashable entry is refused, not a TypeError
        raise ConfigError(f"{path}: architectures={archs!r} is not one moelab imports: {', '.join(ARCHITECTURES)}.")
    spec = _IMPORTS[arch]
    defaults = dict(spec.defaults)
    if "partial_rotary_factor" in (hf.get("rope_parameters") or {}):  # given there: no default beside it
        defaults.pop("partial_rotary_factor", None)
    hf = _HFConfig({**defaults, **{k: v for k, v in hf.items() if v is not None}}, path, arch)
    quantization = hf.get("quantization_config")
    if quantization:
        hf.refuse("quantization_config", quantization.get("quant_method", "set") if isinstance(quantization, dict)
                  else quantization, "moelab reads float weights; dequantize the checkpoint first")
    if hf.get("hidden_act", "silu") != "silu":
        hf.refuse("hidden_act", hf.get("hidden_act"), "moelab's experts are SwiGLU")
    if hf.get("attention_bias") and arch != "Glm4MoeForCausalLM":  # the one class tested logits-equal with it
        hf.refuse("attention_bias", True, f"moelab carries attention biases from Glm4MoeForCausalLM, not yet {arch}")
    if spec.window_switch is None and hf.get("sliding_window") is not None:
        hf.refuse("sliding_window", hf.get("sliding_window"), "moelab attends causally over the whole sequence")
    if spec.window_switch is not None and hf.get(spec.window_switch):
        hf.refuse(spec.window_switch, hf.get(spec.window_switch), "moelab attends causally over the whole sequence")
    d, heads = hf.read("hidden_size"), hf.read("num_attention_heads")
    shape = dict(vocab_size=hf.read("vocab_size"), d_model=d, num_layers=hf.read("num_hidden_layers"), num_heads=heads,
                 num_kv_heads=hf.read("num_key_value_heads", default=heads),
                 head_dim=hf.read("head_dim", default=d // heads) if heads else None,  # no heads: ModelConfig says so
                 seq_len=min(hf.read("max_position_embeddings", default=MAX_SEQ_LEN), MAX_SEQ_LEN),
                 norm_eps=hf.read("rms_norm_eps", float))
    shape["rope_theta"], shape["rope_fraction"] = _rope(hf)
    moe, fields = spec.read(hf)
    dense_ffn_dim = hf.read("intermediate_size") if fields.get("dense_layers") else None
    moe["num_experts_per_token"] = hf.read("num_experts_per_tok")
    try:
        return arch, ModelConfig(**shape, **fields, dense_ffn_dim=dense_ffn_dim, moe=MoEConfig(**moe),
                                 attention_bias=bool(hf.get("attention_bias")))
    except ConfigError as e:  # a value moelab's config refuses: name the file it came from
        raise ConfigError(f"{path}: {e} (from the Hugging Face config's values)") from None


def tensor_files(folder: Path) -> dict[str, Path]:
    """Each tensor's file: from model.safetensors.index.json (sharded) or the one model.safetensors."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{index} is not a safetensors index ({e}); save the model again.") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / WEIGHTS
    if not single.is_file():
        raise DataError(f"{folder} has neither {WEIGHTS} nor {INDEX}: pass the folder save_pretrained wrote.")
    from safetensors import safe_open

    with _opened(single, safe_open) as f:
        return {name: single for name in f.keys()}


class _opened:
    """`safe_open(path)` whose failures (a truncated or damaged header) are a DataError naming the file."""

    def __init__(self, path: Path, safe_open):
        self.path, self.safe_open, self.handle = path, safe_open, None

    def __enter__(self):
        try:
            self.handle = self.safe_open(str(self.path), framework="numpy")
            return self.handle.__enter__()
        except FileNotFoundError:
            raise DataError(f"{self.path} does not exist, but the index names it; save the model again.") from None
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise DataError(f"{self.path} is not a readable safetensors file ({type(e).__name__}: {e}).") from None

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


def _layer_names(arch: str, i: int, e: int | None = None, qk_norm: bool = False, dense: bool = False,
                 bias: bool = False) -> dict[str, str]:
    """moelab key -> tensor name for HF layer i: its attention and MLP (`dense`: a dense block's SwiGLU), or with
    `e` routed expert e's matrices."""
    p = f"model.layers.{i}."
    if e is not None:
        if arch == "MixtralForCausalLM":
            q = f"{p}block_sparse_moe.experts.{e}."
            return {"w_gate": q + "w1.weight", "w_up": q + "w3.weight", "w_down": q + "w2.weight"}
        q = f"{p}mlp.experts.{e}."
        return {"w_gate": q + "gate_proj.weight", "w_up": q + "up_proj.weight", "w_down": q + "down_proj.weight"}
    names = {"attn_norm": p + "input_layernorm.weight", "mlp_norm": p + "post_attention_layernorm.weight",
             "w_q": p + "self_attn.q_proj.weight", "w_k": p + "self_attn.k_proj.weight",
             "w_v": p + "self_attn.v_proj.weight", "w_o": p + "self_attn.o_proj.weight"}
    if qk_norm:
        names.update({"q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"})
    if bias:  # `attention_bias`: q, k and v projections only
        names.update({f"b_{x}": f"{p}self_attn.{x}_proj.bias" for x in "qkv"})
    if dense:
        return {**names, **{f"w_mlp_{name}": f"{p}mlp.{name}_proj.weight" for name in ("gate", "up", "down")}}
    if arch == "MixtralForCausalLM":
        return {**names, "w_router": p + "block_sparse_moe.gate.weight"}
    if arch != "Glm4MoeForCausalLM":
        return {**names, "w_router": p + "mlp.gate.weight"}
    return {**names, "w_router": p + "mlp.gate.weight", "router_bias": p + "mlp.gate.e_score_correction_bias",
            "w_shared_gate": p + "mlp.shared_experts.gate_proj.weight",
            "w_shared_up": p + "mlp.shared_experts.up_proj.weight",
            "w_shared_down": p + "mlp.shared_experts.down_proj.weight"}


def _names(arch: str, cfg: ModelConfig):
    """Every tensor moelab reads, as (params stack, index in it, moelab key, tensor name): HF layer i is dense block
    i for i < dense_layers, else MoE block i - dense_layers (index (block, expert) for a routed expert's)."""
    Ld, qk = cfg.dense_layers, cfg.qk_norm is not None
    for i in range(cfg.num_layers):
        stack, j = ("dense_layers", i) if i < Ld else ("layers", i - Ld)
        for key, name in _layer_names(arch, i, qk_norm=qk, dense=i < Ld, bias=cfg.attention_bias).items():
            yield stack, (j,), key, name
        for e in range(cfg.moe.num_experts if i >= Ld else 0):
            for key, name in _layer_names(arch, i, e).items():
                yield stack, (j, e), key, name


def read_weights(folder: Path, arch: str, cfg: ModelConfig, put) -> tuple[np.ndarray, list[str]]:
    """Read the checkpoint one tensor at a time, handing each to `put(key, index, value)`: `key` a params path
    ("embed", or ("layers", "w_gate")), `index` its layer (and expert) in moelab's stacked array, `value` the
    float32 tensor in moelab's [in, out] layout. Returns (the router bias [L, E] of the L MoE blocks, the tensors
    left out).
    DataError naming the file and tensor when one is missing or has another shape."""
    import jax

    from moelab.model import transformer
    from safetensors import safe_open

    files = tensor_files(folder)
    shapes = jax.eval_shape(lambda: transformer.init(cfg, jax.random.key(0)))
    bias = np.zeros((cfg.num_moe_layers, cfg.moe.num_experts), np.float32)
    handles: dict[Path, Any] = {}

    def read(name: str, shape: tuple, transpose: bool) -> np.ndarray:
        if name not in files:
            raise DataError(f"{folder}: tensor {name} is missing from the checkpoint ({arch} has it).")
        path = files[name]
        if path not in handles:
            handles[path] = _opened(path, safe_open).__enter__()
        try:
            value = handles[path].get_tensor(name)
        except Exception as e:  # a truncated payload, a dtype numpy cannot hold
            raise DataError(f"{path}: tensor {name} cannot be read ({type(e).__name__}: {e}).") from None
        value = np.asarray(value, np.float32)
        value = value.T if transpose else value
        if value.shape != tuple(shape):
            raise DataError(f"{path}: tensor {name} has shape {list(value.shape)}, but config.json makes it "
                            f"{list(shape)}{' (transposed)' if transpose else ''}.")
        return value

    try:
        put("embed", (), read("model.embed_tokens.weight", shapes["embed"].shape, False))
        put("final_norm", (), read("model.norm.weight", shapes["final_norm"].shape, False))
        head = "lm_head.weight" if "lm_head.weight" in files else "model.embed_tokens.weight"  # tied embeddings
        put("lm_head", (), read(head, shapes["lm_head"].shape, True))
        for stack, index, key, name in _names(arch, cfg):
            if key == "router_bias":
                bias[index] = read(name, bias.shape[1:], False)
            elif not (key.startswith("w_shared") and cfg.moe.num_shared_experts == 0):
                shape = shapes[stack][key].shape[len(index):]
                put((stack, key), index, read(name, shape, key.startswith("w_")))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    used = {name for *_, name in _names(arch, cfg)}
    used |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    left_out = sorted(set(files) - used)
    unknown = [name for name in left_out if not _is_mtp_layer(name, cfg.num_layers)]
    if unknown:  # a weight moelab would drop: the model would not be the checkpoint's
        raise DataError(f"{folder}: tensor {unknown[0]} (and {len(unknown) - 1} more) has no place in moelab's "
                        f"{arch} model; a config.json value moelab does not read (attention biases?) may have made it.")
    return bias, left_out


def _is_mtp_layer(name: str, num_layers: int) -> bool:
    """A multi-token-prediction layer's tensor (GLM-4.5, DeepSeek-V3): a layer index past the model's layers."""
    found = re.match(r"model\.layers\.(\d+)\.", name)
    return found is not None and int(found.group(1)) >= num_layers


def _sharded_params(run_cfg: RunConfig, shardings: Any) -> tuple[dict, Any]:
    """Zero params born in `shardings` (the params' part of `state_shardings`), and `put` writing one tensor into
    them: each tensor goes from the host to its shards, so no host holds more than the one being read."""
    import jax

    from moelab.model import transformer

    shapes = jax.eval_shape(lambda: transformer.init(run_cfg.model, jax.random.key(0)))
    params = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=shardings)()
    writers: dict = {}

    def put(key, index: tuple, value: np.ndarray) -> None:
        path = key if isinstance(key, tuple) else (key,)
        holder = params
        for part in path[:-1]:
            holder = holder[part]
        target = holder[path[-1]]
        if path not in writers:  # one compile per kind of tensor: the layer and expert are traced
            def write(array, value, *index):
                starts = (*index, *[0] * value.ndim)
                return jax.lax.dynamic_update_slice(array, value.reshape((1,) * len(index) + value.shape), starts)
            writers[path] = jax.jit(write, donate_argnums=0, out_shardings=target.sharding)
        holder[path[-1]] = writers[path](target, value, *index)

    return params, put


def _run_config(cfg: ModelConfig, name: str, tokenizer: str, mesh: MeshConfig | None) -> RunConfig:
    base = presets.get("tiny")
    mesh = mesh or MeshConfig()
    if mesh.expert > 1:  # experts over the mesh's expert axis: the expert-parallel dispatch (as `--mesh` in train)
        cfg = replace(cfg, moe=replace(cfg.moe, dispatch="ep"))
    return replace(base, name=name, model=cfg, mesh=mesh,
                   data=replace(base.data, tokenizer=tokenizer) if tokenizer != "byte" else base.data)


def import_checkpoint(folder: str | Path, out: str | Path, *, force: bool = False, mesh: MeshConfig | None = None
                      ) -> dict:
    """Import the Hugging Face checkpoint in `folder` as the run directory `out` (see the module docstring), its
    state born on `mesh` (default one device; on CPU the devices must exist: `--xla_force_host_platform_device_count`).

    Returns a summary: architecture, the model's shape, parameters, tensors read and left out, and files.
    """
    import jax

    folder, out = Path(folder), Path(out)
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder: pass a Hugging Face model folder (config.json, *.safetensors).")
    if out.exists() and not force:
        raise ConfigError(f"--out {out} exists: pass a new folder, or --force to replace it once the import is done.")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: pass a folder for the run directory.")
    if out.resolve() == folder.resolve() or out.resolve() in folder.resolve().parents:
        raise ConfigError(f"--out {out} holds the checkpoint being imported ({folder}): pass another folder.")
    hf = read_hf_config(folder)
    arch, cfg = model_config(hf, folder / "config.json")
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file() and cfg.vocab_size < 257:
        raise ConfigError(f"{folder} has no tokenizer.json, and its vocab_size={cfg.vocab_size} is too small for "
                          "moelab's byte tokenizer (257 ids): put the model's tokenizer.json in the folder.")
    run_cfg = _run_config(cfg, out.name, outputs.TOKENIZER if tokenizer.is_file() else "byte", mesh)
    shardings = state_shardings(run_cfg, mesh_lib.make_mesh(run_cfg.mesh))  # ConfigError if devices are missing
    params, put = _sharded_params(run_cfg, shardings.params)
    bias, left_out = read_weights(folder, arch, cfg, put)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if tokenizer.is_file():
            shutil.copyfile(tokenizer, staging / outputs.TOKENIZER)
        (staging / outputs.CONFIG).write_text(dump_yaml(run_cfg))
        (staging / outputs.IMPORTED).write_text(json.dumps({"source": str(folder.resolve()), "architecture": arch}) + "\n")
        opt_state = jax.jit(make_optimizer(run_cfg.train).init, out_shardings=shardings.opt_state)(params)
        router_bias = jax.device_put(jnp.asarray(bias), shardings.router_bias)
        state = TrainState(params, opt_state, router_bias, jax.device_put(jnp.zeros((), jnp.int32), shardings.step),
                           jax.device_put(jnp.zeros_like(jnp.asarray(bias)), shardings.router_load))
        checkpoints = Checkpointer(staging / outputs.CHECKPOINTS, run_cfg.checkpoint)
        try:
            checkpoints.save(0, state, {"imported_from": str(folder.resolve()), "architecture": arch})
        finally:
            checkpoints.close()
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
    return {"architecture": arch, "out": str(out), "num_layers": cfg.num_layers, "d_model": cfg.d_model,
            "num_experts": cfg.moe.num_experts, "top_k": cfg.moe.num_experts_per_token, "params": count,
            "tensors_read": len(tensor_files(folder)) - len(left_out), "tensors_left_out": left_out,
            "tokenizer": "tokenizer.json" if tokenizer.is_file() else "byte", "seq_len": cfg.seq_len,
            "mesh": {"replica": run_cfg.mesh.replica, "expert": run_cfg.mesh.expert}}
