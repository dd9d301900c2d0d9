"""Run configuration: small frozen dataclasses that check themselves, YAML I/O, dotted overrides.

A run is a `RunConfig` holding `ModelConfig` (with its `MoEConfig`), `DataConfig`, `TrainConfig` and
`MeshConfig`. Every field is validated in `__post_init__`; a bad value raises `ConfigError` naming the
field, the value and what is allowed. Rules that need two sections (the mesh against the experts, the
batch and the dispatch backend) are `RunConfig`'s, so a config that constructs is one `train` accepts,
devices permitting. Derive variants with `dataclasses.replace` or `override`; named configs and
"preset or file plus overrides" are `moelab.presets`.

Why one module of ~800 lines: every cross-field rule lives here (architecture §2), so a reader checks what
a config may hold in one place; split by section, the rules between sections would scatter.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moelab.errors import ConfigError

__all__ = [
    "MoEConfig",
    "ModelConfig",
    "DomainConfig",
    "PhaseConfig",
    "DataConfig",
    "TrainConfig",
    "MeshConfig",
    "CheckpointConfig",
    "MonitorConfig",
    "PlanConfig",
    "RunConfig",
    "from_dict",
    "to_dict",
    "read_yaml",
    "load_yaml",
    "resolve_data_paths",
    "read_data_yaml",
    "dump_yaml",
    "changed_fields",
    "override",
    "parse_overrides",
]


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: {allowed}.")


def _divisors(n: int) -> list[int]:
    """n's divisors, ascending: the mesh sizes an error can offer."""
    return [d for d in range(1, n + 1) if n % d == 0] if isinstance(n, int) and 0 < n <= 10**6 else []


def _positive_int(name: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, value, "must be an integer >= 1")


def _positive_int_or_null(name: str, value: Any, unset_means: str) -> None:
    """A field that may be unset (None) but not 0: the message says how to unset it, since `=0` is the
    spelling a user reaches for first."""
    try:
        _positive_int(name, value)
    except ConfigError as e:
        raise ConfigError(f"{str(e).removesuffix('.')}, or null to unset it ({unset_means}): --set {name}=null.") from None


def _non_negative_int(name: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name, value, "must be an integer >= 0")


def _one_of(name: str, value: Any, options: tuple[str, ...]) -> None:
    _check(value in options, name, value, f"must be one of {', '.join(options)}")


_FINITE = "must be a finite number (not .inf, .nan or a value too large for a float, such as 1e999)"


def _finite_floats(cfg: Any, prefix: str) -> None:
    """Refuse inf and NaN in every float field of `cfg`: a range check such as `lr > 0` lets inf through."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float):
            _check(math.isfinite(value), prefix + f.name, value, _FINITE)


DISPATCH_BACKENDS = ("dense", "capacity", "dropless", "grouped", "ep")
ROUTER_SCORES = ("sigmoid", "softmax")
BALANCERS = ("none", "exact", "hist", "sign", "aux")
# The knobs of MoEConfig each balancing rule reads. One set away from its default under a rule that does not
# read it is refused, naming it: it would be silently ignored, and a run would not be the one its config says.
BALANCER_KNOBS = {"none": (), "exact": ("balance_rate", "rebalance_steps", "rebalance_iterations"),
                  "hist": ("balance_rate", "hist_bins", "rebalance_steps", "rebalance_iterations"),
                  "sign": ("sign_gamma",), "aux": ("aux_loss_weight",)}
DTYPES = ("float32", "bfloat16")
REMAT = ("none", "dots", "full")  # what a block saves for the backward pass (`transformer._remat`)
QK_NORMS = ("head", "full")  # `ModelConfig.qk_norm`: over each head, or over the whole projection


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts, the shared experts, the latent projection and how tokens reach experts."""

    num_experts: int = 8
    num_experts_per_token: int = 2  # top-k
    expert_dim: int = 64  # SwiGLU hidden width of one routed expert
    num_shared_experts: int = 0
    shared_expert_dim: int | None = None  # None: same as expert_dim
    latent_dim: int | None = None  # None: no LatentMoE; else experts run at this width
    router_score: str = "sigmoid"
    normalize_weights: bool = True  # renormalize the chosen experts' scores to sum to 1
    routed_scaling: float = 1.0  # the combine weights then sum to this
    num_groups: int = 1  # > 1: group-limited selection (`router.within_best_groups`; DeepSeek-V3's n_group)
    groups_per_token: int = 1  # the groups each token chooses among, when num_groups > 1 (topk_group)
    capacity_factor: float = 1.15
    dispatch: str = "capacity"
    balancing: str = "none"  # none | exact / hist (quantile bias) | sign (bias step) | aux (loss term)
    balance_rate: float | None = None  # exact / hist: weight of the new bias target; None: (E - 1) / E
    hist_bins: int = 256  # hist: histogram bins per expert over the live range of the margins
    sign_gamma: float = 1e-3  # sign: bias change per step
    aux_loss_weight: float = 1e-2  # aux: weight of the Switch load-balancing loss, per layer
    rebalance_steps: int = 0  # exact / hist: for the first N steps the bias is also solved on each batch itself
    rebalance_iterations: int = 3  # quantile steps of that in-batch solve (`balancing.rebalance_on_batch`)
    num_waves: int = 1  # static expert waves in the `ep` all-to-all
    transport_capacity_factor: float | None = None
    """`ep` only: the rows each device may send one expert shard per wave, as a multiple of the fair
    share; past it, rows are dropped at the sender. None: the same as `capacity_factor`, which in
    `ep` sizes the receiving experts' buffers."""

    def __post_init__(self) -> None:
        p = "model.moe."
        _finite_floats(self, p)
        _positive_int(p + "num_experts", self.num_experts)
        _positive_int(p + "num_experts_per_token", self.num_experts_per_token)
        _check(
            self.num_experts_per_token <= self.num_experts,
            p + "num_experts_per_token",
            self.num_experts_per_token,
            f"top-k cannot exceed model.moe.num_experts={self.num_experts}",
        )
        _positive_int(p + "expert_dim", self.expert_dim)
        _non_negative_int(p + "num_shared_experts", self.num_shared_experts)
        if self.shared_expert_dim is not None:
            _positive_int_or_null(p + "shared_expert_dim", self.shared_expert_dim, "same width as expert_dim")
        if self.latent_dim is not None:
            _positive_int_or_null(p + "latent_dim", self.latent_dim, "no LatentMoE")
        _one_of(p + "router_score", self.router_score, ROUTER_SCORES)
        _check(self.routed_scaling > 0, p + "routed_scaling", self.routed_scaling, "must be > 0")
        _check(
            isinstance(self.capacity_factor, (int, float)) and self.capacity_factor > 0,
            p + "capacity_factor",
            self.capacity_factor,
            "must be > 0 (1.0 = exactly the fair share per expert; 1.15 is the frontier recipe)",
        )
        _one_of(p + "dispatch", self.dispatch, DISPATCH_BACKENDS)
        _one_of(p + "balancing", self.balancing, BALANCERS)
        if self.balancing in ("exact", "hist"):
            _check(
                self.num_experts_per_token < self.num_experts,
                p + "balancing",
                self.balancing,
                f"quantile balancing needs top-k < num_experts={self.num_experts} (with every expert chosen "
                "there is nothing to balance); use balancing 'none'",
            )
        if self.balance_rate is not None:
            _check(0 < self.balance_rate <= 1, p + "balance_rate", self.balance_rate, "must be in (0, 1], or null")
        _check(isinstance(self.hist_bins, int) and self.hist_bins >= 2, p + "hist_bins", self.hist_bins,
               "must be an integer >= 2")
        _non_negative_int(p + "rebalance_steps", self.rebalance_steps)
        _positive_int(p + "rebalance_iterations", self.rebalance_iterations)
        if self.rebalance_steps > 0:
            _check(self.balancing in ("exact", "hist"), p + "rebalance_steps", self.rebalance_steps,
                   f"solves the quantile bias on each batch, so it needs model.moe.balancing 'hist' or 'exact' "
                   f"(not {self.balancing!r}); or set it to 0")
        _check(self.sign_gamma > 0, p + "sign_gamma", self.sign_gamma, "must be > 0")
        _check(self.aux_loss_weight >= 0, p + "aux_loss_weight", self.aux_loss_weight, "must be >= 0")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for knob in sorted({k for knobs in BALANCER_KNOBS.values() for k in knobs} - set(self.balancer_settings)):
            readers = " or ".join(repr(rule) for rule, knobs in BALANCER_KNOBS.items() if knob in knobs)
            _check(getattr(self, knob) == defaults[knob], p + knob, getattr(self, knob),
                   f"only balancing {readers} reads it, and this config uses balancing {self.balancing!r}: remove it, "
                   f"or set model.moe.balancing to {readers}")
        _positive_int(p + "num_waves", self.num_waves)
        _positive_int(p + "num_groups", self.num_groups)
        _positive_int(p + "groups_per_token", self.groups_per_token)
        if self.num_groups > 1:
            _check(self.num_experts % self.num_groups == 0 and self.num_experts // self.num_groups >= 2,
                   p + "num_groups", self.num_groups,
                   f"must split model.moe.num_experts={self.num_experts} into equal groups of at least 2 (a group "
                   "scores the sum of its two best experts)")
            _check(self.balancing not in ("exact", "hist"), p + "balancing", self.balancing,
                   f"the quantile rules solve the bias for plain top-k selection, not for selection within groups "
                   f"(model.moe.num_groups={self.num_groups}): use 'sign' (DeepSeek-V3's rule; it reads only the "
                   "loads) or 'none'")
            _check(self.groups_per_token <= self.num_groups
                   and self.groups_per_token * (self.num_experts // self.num_groups) >= self.num_experts_per_token,
                   p + "groups_per_token", self.groups_per_token,
                   f"must be at most num_groups={self.num_groups} and leave at least top-k="
                   f"{self.num_experts_per_token} experts to choose from")
        if self.transport_capacity_factor is not None:
            _check(
                isinstance(self.transport_capacity_factor, (int, float)) and self.transport_capacity_factor > 0,
                p + "transport_capacity_factor",
                self.transport_capacity_factor,
                "must be > 0, or null to use model.moe.capacity_factor",
            )

    @property
    def resolved_shared_expert_dim(self) -> int:
        return self.shared_expert_dim if self.shared_expert_dim is not None else self.expert_dim

    @property
    def balancer_settings(self) -> dict[str, Any]:
        """The knobs the balancing rule in use reads (`BALANCER_KNOBS`), with their values."""
        return {knob: getattr(self, knob) for knob in BALANCER_KNOBS[self.balancing]}

    @property
    def resolved_transport_capacity_factor(self) -> float:
        """`ep`'s sender pool factor, resolved once: `transport_capacity_factor`, or `capacity_factor` when None."""
        return self.transport_capacity_factor if self.transport_capacity_factor is not None else self.capacity_factor


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape. Attention is GQA with RoPE; every block's MLP is the MoE block, except the first
    `dense_layers`, whose MLP is one dense SwiGLU."""

    vocab_size: int = 512
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: d_model // num_heads
    seq_len: int = 64
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0  # the share of each head's dimensions RoPE rotates (GLM-4.5: 0.5); the rest pass as is
    norm_eps: float = 1e-6
    z_loss_weight: float = 0.0  # weight of the squared log-partition term; 0 disables it
    # Init std of the token embedding. Against 0.02, attention's output at init (close to each
    # sequence's running mean) outgrows the tokens within two layers, and every token of a sequence
    # routes alike (issue 39, benchmarks/early_training.py).
    embed_std: float = 0.02
    remat: str = "none"  # none: save everything; dots: save matmul outputs, recompute the rest; full: save inputs
    qk_norm: str | None = None
    """RMSNorm of the queries and keys before RoPE, with learned gains: None (off), "head" (over each head's
    head_dim, one gain vector shared by the heads: Qwen3-MoE, GLM-4.5) or "full" (over the whole
    projection, num_heads x head_dim for q: OLMoE). Imported checkpoints need it; it trains from scratch too."""
    attention_bias: bool = False
    """Learned biases on the query, key and value projections (GLM-4.5's and Qwen2's `attention_bias`; the output
    projection has none). Imported checkpoints need it; it trains from scratch too (the biases start at zero)."""
    dense_layers: int = 0
    """How many blocks, counted from the first, run one dense SwiGLU MLP of width `dense_ffn_dim` instead of
    the MoE block (DeepSeek-V3's and GLM-4.5's `first_k_dense_replace`: the first layers' tokens are not yet
    specific enough to route well). `num_layers` counts them; the router bias and the per-layer MoE metrics
    cover the num_layers - dense_layers MoE blocks only."""
    dense_ffn_dim: int | None = None  # the dense layers' SwiGLU width; None: the MoE block's active width
    fp8: bool = False
    """FP8 matmuls (`moelab.model.fp8`): every attention and MLP projection and every expert GEMM reads e4m3
    operands (activations scaled per row, weights per tensor or per expert) and e5m2 gradients, accumulating in
    float32; the router, norms, softmaxes and the lm head keep the compute dtype. On a GPU it needs compute
    capability 8.9 (Ada, Hopper) and a dispatch other than `grouped`; on a CPU it runs as an emulation."""
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        p = "model."
        _finite_floats(self, p)
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "seq_len"):
            _positive_int(p + name, getattr(self, name))
        if self.head_dim is None:
            _check(
                self.d_model % self.num_heads == 0,
                p + "num_heads",
                self.num_heads,
                f"must divide model.d_model={self.d_model}; or set model.head_dim explicitly",
            )
        else:
            _positive_int_or_null(p + "head_dim", self.head_dim, "d_model // num_heads")
        _check(self.resolved_head_dim % 2 == 0, p + "head_dim", self.resolved_head_dim,
               "must be even: RoPE rotates pairs of dimensions")
        _check(
            self.num_heads % self.num_kv_heads == 0,
            p + "num_kv_heads",
            self.num_kv_heads,
            f"must divide model.num_heads={self.num_heads} (grouped-query attention)",
        )
        _check(self.rope_theta > 0, p + "rope_theta", self.rope_theta, "must be > 0")
        _check(0 < self.rope_fraction <= 1 and int(self.resolved_head_dim * self.rope_fraction) % 2 == 0
               and int(self.resolved_head_dim * self.rope_fraction) > 0, p + "rope_fraction", self.rope_fraction,
               f"must be in (0, 1] and rotate an even, non-zero number of the head's {self.resolved_head_dim} "
               "dimensions")
        _check(self.z_loss_weight >= 0, p + "z_loss_weight", self.z_loss_weight, "must be >= 0")
        _check(self.embed_std > 0, p + "embed_std", self.embed_std, "must be > 0")
        _one_of(p + "remat", self.remat, REMAT)
        _check(isinstance(self.dense_layers, int) and not isinstance(self.dense_layers, bool)
               and 0 <= self.dense_layers < self.num_layers, p + "dense_layers", self.dense_layers,
               f"must be an integer in [0, model.num_layers={self.num_layers}): at least one block is a MoE block")
        _check(isinstance(self.fp8, bool), p + "fp8", self.fp8, "must be true or false")
        _check(isinstance(self.attention_bias, bool), p + "attention_bias", self.attention_bias, "must be true or false")
        if self.fp8 and self.moe.dispatch == "grouped":  # refused on any machine, so a plan on a CPU says what a GPU would
            raise ConfigError("model.fp8=true with model.moe.dispatch='grouped': the Pallas grouped GEMM has no FP8 "
                              "path. Use --set model.moe.dispatch=capacity (or ep on several devices), or "
                              "model.fp8=false.")
        if self.dense_ffn_dim is not None:
            _positive_int_or_null(p + "dense_ffn_dim", self.dense_ffn_dim, "the MoE block's active width")
        if self.qk_norm is not None:
            _one_of(p + "qk_norm", self.qk_norm, QK_NORMS)
        _check(isinstance(self.moe, MoEConfig), p + "moe", self.moe, "must be a MoEConfig")
        if self.moe.latent_dim is not None:
            _check(self.moe.latent_dim < self.d_model, "model.moe.latent_dim", self.moe.latent_dim,
                   f"must be smaller than model.d_model={self.d_model}: the latent compresses the experts' input "
                   f"(d_model / 2 = {self.d_model // 2} is the usual width); set null for no latent")
        if self.moe.dispatch == "grouped":  # Triton's MMA tiles are multiples of 16 (grouped_matmul.MIN_TILE)
            input_name = "model.moe.latent_dim" if self.moe.latent_dim is not None else "model.d_model"
            for name, width in (("model.moe.expert_dim", self.moe.expert_dim), (input_name, self.expert_input_dim)):
                _check(width % 16 == 0, name, width,
                       "must be a multiple of 16 for dispatch 'grouped'; pick another width or dispatch 'capacity'")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def num_moe_layers(self) -> int:
        """The blocks whose MLP is the MoE block: the last num_layers - dense_layers."""
        return self.num_layers - self.dense_layers

    @property
    def resolved_dense_ffn_dim(self) -> int:
        """The dense layers' SwiGLU width: `dense_ffn_dim`, or the hidden units one token meets in a MoE block
        (top-k experts plus the shared ones), so a dense layer costs what the MoE block it replaces does."""
        if self.dense_ffn_dim is not None:
            return self.dense_ffn_dim
        m = self.moe
        return m.num_experts_per_token * m.expert_dim + m.num_shared_experts * m.resolved_shared_expert_dim

    @property
    def expert_input_dim(self) -> int:
        """Width of the rows the routed experts see: the latent width under LatentMoE, else d_model."""
        return self.moe.latent_dim if self.moe.latent_dim is not None else self.d_model


EMBEDDED_DOMAINS = ("code", "prose", "arithmetic")


DOMAIN_KINDS = ("embedded", "files", "store")


@dataclass(frozen=True)
class DomainConfig:
    """One data domain: an embedded one (`code`, `prose`, `arithmetic`), the user's files, or a prepared store's.

    `store` (or `data.store` for every domain) trains on the domain's tokens in a token store written by
    `moelab data prepare` instead of reading and tokenizing its sources at start-up; `kind: store` names a
    domain that exists only in a store.
    """

    name: str
    kind: str = "embedded"  # "embedded", "files" or "store"
    paths: tuple[str, ...] = ()  # .txt / .jsonl (a "text" field) / .parquet (a "text" column), globs, .gz / .zst
    store: str | None = None  # a token store (local path or s3:// / gs:// URL) holding this domain

    def __post_init__(self) -> None:
        _one_of(f"data.domains[{self.name}].kind", self.kind, DOMAIN_KINDS)
        if self.kind == "embedded":
            _one_of(f"data.domains[{self.name}].name", self.name, EMBEDDED_DOMAINS)
        elif self.kind == "files":
            _check(len(self.paths) > 0, f"data.domains[{self.name}].paths", self.paths, "list at least one file")


@dataclass(frozen=True)
class PhaseConfig:
    """A training phase: a share of the steps and the domain weights used during it."""

    name: str
    fraction: float
    weights: dict[str, float]

    def __post_init__(self) -> None:
        p = f"data.phases[{self.name}]."
        _finite_floats(self, p)
        for domain, weight in self.weights.items():
            _check(isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight),
                   f"{p}weights.{domain}", weight, _FINITE)
        _check(0 < self.fraction <= 1, p + "fraction", self.fraction, "must be in (0, 1]")
        _check(
            bool(self.weights) and all(w >= 0 for w in self.weights.values()) and sum(self.weights.values()) > 0,
            p + "weights",
            self.weights,
            "give non-negative weights with a positive sum",
        )


def _default_domains() -> tuple[DomainConfig, ...]:
    return tuple(DomainConfig(name) for name in EMBEDDED_DOMAINS)


def _default_phases(domains: tuple[DomainConfig, ...]) -> tuple[PhaseConfig, ...]:
    """The phases of a data section that lists none: the embedded mixture for the embedded domains, else one
    phase with equal weights (so your own domains need no phases to start with)."""
    if tuple(d.name for d in domains) == EMBEDDED_DOMAINS:
        # Pre-training favours code and prose; mid-training shifts weight toward arithmetic (architecture §3b).
        return (
            PhaseConfig("pretrain", 0.8, {"code": 0.45, "prose": 0.45, "arithmetic": 0.10}),
            PhaseConfig("midtrain", 0.2, {"code": 0.25, "prose": 0.25, "arithmetic": 0.50}),
        )
    return (PhaseConfig("pretrain", 1.0, {d.name: 1.0 for d in domains}),)


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from: domains, the tokenizer, phases with mixture weights, held-out split."""

    domains: tuple[DomainConfig, ...] = field(default_factory=_default_domains)
    phases: tuple[PhaseConfig, ...] = ()  # none given: `_default_phases(domains)`
    tokenizer: str = "byte"  # "byte", "bpe" (train one on the sources) or a path to tokenizer.json
    bpe_vocab_size: int = 1024  # only with tokenizer="bpe"
    heldout_fraction: float = 0.1  # share of each domain's documents held out for eval
    max_bytes_per_domain: int = 4_000_000  # caps each embedded domain (not user files) so start-up stays fast
    seed: int = 0  # the content of generated data (the arithmetic domain); train.seed is init and data order
    store: str | None = None  # a token store (`moelab data prepare`) every domain without its own `store` reads
    # None: the arithmetic domain's operands are uniform below 1000. N: each operand's digit count is drawn from
    # 1..N first, so short problems are common and a small model's exact match rises from 0 with scale.
    arithmetic_digits: int | None = None

    def __post_init__(self) -> None:
        _finite_floats(self, "data.")
        if self.arithmetic_digits is not None:
            _check(isinstance(self.arithmetic_digits, int) and not isinstance(self.arithmetic_digits, bool)
                   and 1 <= self.arithmetic_digits <= 6, "data.arithmetic_digits", self.arithmetic_digits,
                   "must be an integer in 1..6 (the largest operand's digit count), or null for operands below 1000")
        _non_negative_int("data.seed", self.seed)
        names = [d.name for d in self.domains]
        _check(len(names) > 0, "data.domains", names, "list at least one domain")
        _check(len(set(names)) == len(names), "data.domains", names, "domain names must be unique")
        if not self.phases:
            object.__setattr__(self, "phases", _default_phases(self.domains))
        for d in self.domains:
            _check(d.kind != "store" or d.store or self.store, f"data.domains[{d.name}].store", d.store,
                   "a domain of kind 'store' needs a store: set its store, or data.store, to a prepared token store")
        from_store = [d.name for d in self.domains if d.store or self.store]
        _check(not from_store or len(from_store) == len(names), "data.domains",
               f"{from_store} from a store, the rest not", "either every domain reads a token store (all share its "
               "tokenizer) or none does; prepare the others into a store too (`moelab data prepare`)")
        total = sum(ph.fraction for ph in self.phases)
        _check(math.isclose(total, 1.0, abs_tol=1e-6), "data.phases", [ph.fraction for ph in self.phases],
               "phase fractions must sum to 1")
        for ph in self.phases:
            unknown = sorted(set(ph.weights) - set(names))
            _check(not unknown, f"data.phases[{ph.name}].weights", unknown,
                   f"names domains that are not in data.domains ({', '.join(names)})")
        _check(self.tokenizer in ("byte", "bpe") or self.tokenizer.endswith(".json"), "data.tokenizer",
               self.tokenizer, "use 'byte', 'bpe' or a path to a tokenizer.json")
        _check(self.bpe_vocab_size >= 260, "data.bpe_vocab_size", self.bpe_vocab_size, "must be >= 260")
        _check(0 < self.heldout_fraction < 1, "data.heldout_fraction", self.heldout_fraction, "must be in (0, 1)")
        _positive_int("data.max_bytes_per_domain", self.max_bytes_per_domain)


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer, schedule, batch and the loop's cadence."""

    steps: int = 200
    batch_size: int = 16  # global, in sequences
    lr: float = 3e-3  # peak
    min_lr_ratio: float = 0.1  # final LR = lr * min_lr_ratio
    warmup_steps: int = 20  # clamped to `steps` for short runs
    schedule: str = "wsd"  # "wsd" (warmup-stable-decay) or "cosine"
    decay_fraction: float = 0.2  # WSD: last share of steps spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global-norm clip threshold
    compute_dtype: str = "float32"  # params stay float32; "bfloat16" casts activations and weights in the step
    # Adam's two moments as stored between steps; the update itself is computed in float32. bfloat16 halves the
    # optimizer state (DeepSeek-V3 trained with bfloat16 moments, reporting no loss of quality).
    moment_dtype: str = "float32"
    # The dtype the gradient crosses racks in, once a step (`parallel.spmd.reduce_gradients`; inside a rack it is
    # always float32). float32 is what Megatron and FSDP recipes reduce bf16 runs in; bfloat16 halves the network
    # bytes, each partial sum of the ring rounded to bfloat16 on the way.
    grad_reduce_dtype: str = "float32"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4  # per domain
    mixture_snapshot_every: int = 100  # steps between realized-token snapshots in OUT/mixture_log.jsonl
    # Gradient accumulation: the step runs batch_size / microbatches sequences at a time and applies one update
    # for the whole batch (the same update to float32 rounding where no token is dropped; memory for activations
    # falls by this factor). Microbatch m holds rows m, m + M, m + 2M, ... so every device keeps its share.
    microbatches: int = 1

    def __post_init__(self) -> None:
        p = "train."
        _finite_floats(self, p)
        for name in ("steps", "batch_size", "log_every", "eval_every", "eval_batches", "mixture_snapshot_every",
                     "microbatches"):
            _positive_int(p + name, getattr(self, name))
        _non_negative_int(p + "warmup_steps", self.warmup_steps)
        _non_negative_int(p + "seed", self.seed)
        _check(self.lr > 0, p + "lr", self.lr, "must be > 0")
        _check(0 <= self.min_lr_ratio <= 1, p + "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _one_of(p + "schedule", self.schedule, ("wsd", "cosine"))
        _check(0 <= self.decay_fraction <= 1, p + "decay_fraction", self.decay_fraction, "must be in [0, 1]")
        _check(self.weight_decay >= 0, p + "weight_decay", self.weight_decay, "must be >= 0")
        _check(0 <= self.beta1 < 1, p + "beta1", self.beta1, "must be in [0, 1)")
        _check(0 <= self.beta2 < 1, p + "beta2", self.beta2, "must be in [0, 1)")
        _check(self.grad_clip > 0, p + "grad_clip", self.grad_clip, "must be > 0")
        _one_of(p + "compute_dtype", self.compute_dtype, DTYPES)
        _one_of(p + "moment_dtype", self.moment_dtype, DTYPES)
        _one_of(p + "grad_reduce_dtype", self.grad_reduce_dtype, DTYPES)


SHARD_LAYOUTS = ("replicate", "optimizer", "rack", "full")  # what of the train state is split over the mesh (`parallel.mesh`)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh: data parallel across `replica` groups, expert parallel inside each (a "rack")."""

    replica: int = 1
    expert: int = 1
    # Routed experts are always split over `expert`. The rest of the state:
    #   replicate: every non-expert parameter and its Adam moments on every device (no extra collectives);
    #   optimizer: Adam moments split over the whole mesh (ZeRO-1), the experts' over `replica` too;
    #   rack:      the non-expert parameters, gradients and moments split over `expert`, whole on each rack
    #              (HSDP): parameters gathered inside the rack where a layer reads them; the update is local,
    #              so only the gradient crosses racks, once a step;
    #   full:      parameters as `rack`, moments split over the whole mesh as in `optimizer` (their new
    #              values all-gathered across racks once a step).
    # replicate suits one device and small models; a model whose replicated state does not fit wants rack.
    shard: str = "replicate"

    def __post_init__(self) -> None:
        _positive_int("mesh.replica", self.replica)
        _positive_int("mesh.expert", self.expert)
        _one_of("mesh.shard", self.shard, SHARD_LAYOUTS)

    @property
    def num_devices(self) -> int:
        return self.replica * self.expert


@dataclass(frozen=True)
class CheckpointConfig:
    """When to save and what to keep. Saves are atomic; a resume picks the newest valid one."""

    every: int | None = None  # steps between saves; None: only at the end and on SIGTERM / SIGINT
    keep_last: int = 3  # the newest K are kept
    keep_every: int | None = None  # also keep every M-th step forever; None keeps no extra ones

    def __post_init__(self) -> None:
        if self.every is not None:
            _positive_int_or_null("checkpoint.every", self.every, "only at the end and on SIGTERM / SIGINT")
        _positive_int("checkpoint.keep_last", self.keep_last)
        if self.keep_every is not None:
            _positive_int_or_null("checkpoint.keep_every", self.keep_every, "keep no extra checkpoints")


@dataclass(frozen=True)
class MonitorConfig:
    """Spike, NaN and ceiling rules that turn trouble into incidents (`train/monitor.py`)."""

    recent_window: int = 5  # steps whose floor (minimum) is compared with the trailing mean
    trailing_window: int = 50  # steps the mean and sigma are taken over, before the recent window
    min_jump: float = 0.05  # a spike must exceed the trailing mean by at least this (absolute) ...
    num_sigmas: float = 6.0  # ... and by this many trailing standard deviations
    grad_norm_ceiling: float | None = None  # an incident when the global grad norm exceeds it; None: off
    skip_spikes: bool = False  # drop the update of a step whose loss is above the spike threshold

    def __post_init__(self) -> None:
        _finite_floats(self, "monitor.")
        _positive_int("monitor.recent_window", self.recent_window)
        _positive_int("monitor.trailing_window", self.trailing_window)
        _check(self.min_jump >= 0, "monitor.min_jump", self.min_jump, "must be >= 0")
        _check(self.num_sigmas >= 0, "monitor.num_sigmas", self.num_sigmas, "must be >= 0")
        if self.grad_norm_ceiling is not None:
            _check(self.grad_norm_ceiling > 0, "monitor.grad_norm_ceiling", self.grad_norm_ceiling, "must be > 0")


@dataclass(frozen=True)
class PlanConfig:
    """The compute plan behind the token budget, read by the contingency planner (`moelab replan`).

    The token budget itself is `train.steps x train.batch_size x model.seq_len`; this section says
    how fast the planned devices train and by when the run must finish.
    """

    num_devices: int = 1
    tokens_per_s: float | None = None  # throughput with all num_devices; None: unknown (replan refuses)
    deadline_hours: float | None = None  # wall clock from the start; None: budget / tokens_per_s exactly

    def __post_init__(self) -> None:
        _finite_floats(self, "plan.")
        _positive_int("plan.num_devices", self.num_devices)
        if self.tokens_per_s is not None:
            _check(self.tokens_per_s > 0, "plan.tokens_per_s", self.tokens_per_s, "must be > 0")
        if self.deadline_hours is not None:
            _check(self.deadline_hours > 0, "plan.deadline_hours", self.deadline_hours, "must be > 0")


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs."""

    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    def __post_init__(self) -> None:
        # Cross-section checks: the ones that need two sections at once.
        moe = self.model.moe
        _check(
            moe.num_experts % self.mesh.expert == 0,
            "model.moe.num_experts",
            moe.num_experts,
            f"must be divisible by mesh.expert={self.mesh.expert} so each expert shard holds whole experts "
            f"(mesh.expert that would work: {', '.join(map(str, _divisors(moe.num_experts)))})",
        )
        _check(
            self.train.batch_size % self.mesh.num_devices == 0,
            "train.batch_size",
            self.train.batch_size,
            f"must be divisible by the {self.mesh.num_devices} devices of mesh "
            f"replica={self.mesh.replica} x expert={self.mesh.expert} (device counts that would work: "
            f"{', '.join(map(str, _divisors(self.train.batch_size)[:12]))})",
        )
        per_microbatch = self.mesh.num_devices * self.train.microbatches
        _check(
            self.train.batch_size % per_microbatch == 0,
            "train.microbatches",
            self.train.microbatches,
            f"must split train.batch_size={self.train.batch_size} into microbatches that each give the "
            f"{self.mesh.num_devices} device(s) whole sequences (batch_size divisible by devices x microbatches "
            f"= {per_microbatch})",
        )
        # Only `ep` runs experts sharded over devices; `grouped`'s Pallas kernel cannot be split by the
        # SPMD partitioner at all, so on several devices each would redo the whole layer.
        if moe.dispatch == "grouped" and self.mesh.num_devices > 1:
            raise ConfigError(
                f"model.moe.dispatch='grouped' runs on one device, but the mesh has {self.mesh.num_devices}: its "
                "Pallas kernel cannot be split over devices (each would redo the whole layer). Use dispatch 'ep' "
                "across devices, or 'grouped' with mesh.replica=1, mesh.expert=1."
            )
        if moe.balancing == "exact" and self.mesh.num_devices > 1:
            raise ConfigError(
                f"model.moe.balancing='exact' sorts every token's selection margins on one device, but the mesh has "
                f"{self.mesh.num_devices} devices and each routes its own tokens. Use balancing 'hist' (the same "
                "quantile from one histogram summed over the devices), or a one-device mesh.")
        if self.mesh.expert > 1 and moe.dispatch != "ep":
            raise ConfigError(
                f"model.moe.dispatch={moe.dispatch!r} cannot run with mesh.expert={self.mesh.expert}: experts "
                "sharded over devices need the expert-parallel backend; set model.moe.dispatch=ep, or "
                "mesh.expert=1 for data parallelism only."
            )


# ----------------------------------------------------------------------------------------------
# dict / YAML conversion


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Turn plain YAML data into the annotated type `tp` (dataclasses, tuples, optionals)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}.")
        return _build(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], where)
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp) if len(typing.get_args(tp)) == 2 else (typing.get_args(tp)[0], ...)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}.")
        return tuple(_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}.")
        return {str(k): _convert(v, float, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        return _to_float(value, where)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if tp in (int, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{where}={value!r} must be of type {tp.__name__}.")
    return value


def _to_float(value: Any, where: str) -> float:
    """A finite float from a YAML number, or from text such as `1e-3` (YAML 1.1 reads a number without a dot
    as a string); `.inf`, `.nan` and `1e999` (which overflows to inf) are refused, naming `where`."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise ConfigError(f"{where}={value!r} must be a number, e.g. 0.5 or 1e-3.")
    if not math.isfinite(number):
        raise ConfigError(f"{where}={value!r} is invalid: {_FINITE}.")
    return float(number)


def _build(cls: type, data: dict, where: str) -> Any:
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    prefix = f"{where}." if where else ""
    if unknown:
        raise ConfigError(
            f"Unknown key {prefix}{unknown[0]}{did_you_mean(unknown[0], names)}; the keys allowed here are: "
            f"{', '.join(names)}."
        )
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]} is required; give it a value (the keys allowed here are: "
                          f"{', '.join(names)}).")
    kwargs = {}
    for name in names:
        if name in data:
            sub = f"{where}.{name}" if where else name
            kwargs[name] = _convert(data[name], hints[name], sub)
    return cls(**kwargs)


def from_dict(data: dict, cls: type = RunConfig) -> Any:
    """Build `cls` from nested plain data, rejecting unknown keys by name."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"a {cls.__name__} must be a mapping at the top level, got {type(data).__name__}.")
    return _build(cls, data, "")


def to_dict(cfg: Any) -> Any:
    """Nested plain data (lists, dicts, scalars) that `from_dict` reads back to an equal config."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (tuple, list)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def read_yaml(path: str | Path, kind: str, instead: str) -> Any:
    """The data in the YAML file `path`; a missing file or bad syntax raises ConfigError naming it.

    `kind` names the file in the message ("config", "spec", "recipe"); `instead` is what to pass
    when the file does not exist, e.g. "pass a ladder recipe YAML".
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{kind} file {path} does not exist; {instead}.")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{kind} file {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}; "
                          "fix the syntax (see experiments/*.yaml for examples).") from None


def load_yaml(path: str | Path) -> RunConfig:
    """Read a RunConfig from YAML; a missing file or bad syntax raises ConfigError naming the file.

    Relative data paths (sources, stores, a tokenizer.json) are read against the YAML file's folder.
    """
    data = read_yaml(path, "config", "pass a YAML file or --preset NAME")
    if isinstance(data, dict) and isinstance(data.get("data"), dict):
        data = {**data, "data": resolve_data_paths(data["data"], Path(path).parent)}
    return from_dict(data)


def read_data_yaml(path: str | Path) -> dict:
    """The data section in the YAML file `path` (a `data:` mapping, or the section's fields at the top level),
    complete and checked, with relative paths read against the file's folder: `--data FILE` puts it in place
    of a preset's."""
    data = read_yaml(path, "data", "pass a YAML file holding a data section (see the README's Data section)")
    if isinstance(data, dict) and set(data) == {"data"}:
        data = data["data"]
    if not isinstance(data, dict):
        raise ConfigError(f"data file {path} must hold a mapping (data: {{domains: [...], phases: [...]}}), got "
                          f"{type(data).__name__}.")
    return to_dict(_build(DataConfig, resolve_data_paths(data, Path(path).parent), "data"))


def _against(value: Any, folder: Path) -> Any:
    """`value` (a path, a glob or a URL) read against `folder` when it is a relative local path."""
    if not isinstance(value, str) or "://" in value or value.startswith("hf:") or Path(value).is_absolute():
        return value
    return str(folder / value)


def resolve_data_paths(data: dict, folder: Path) -> dict:
    """A plain `data` section with its relative paths (domain paths and stores, data.store, a tokenizer.json)
    made relative to `folder`, the folder of the YAML file they were written in."""
    data = dict(data)
    folder = folder.absolute()
    if isinstance(data.get("tokenizer"), str) and data["tokenizer"].endswith(".json"):
        data["tokenizer"] = _against(data["tokenizer"], folder)
    if "store" in data:
        data["store"] = _against(data["store"], folder)
    if isinstance(data.get("domains"), list):
        domains = []
        for domain in data["domains"]:
            if isinstance(domain, dict):
                domain = dict(domain)
                if isinstance(domain.get("paths"), list):
                    domain["paths"] = [_against(p, folder) for p in domain["paths"]]
                if "store" in domain:
                    domain["store"] = _against(domain["store"], folder)
            domains.append(domain)
        data["domains"] = domains
    return data


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Parse `a.b.c=value` strings; values are read as YAML scalars (`3`, `1e-3`, `true`, `null`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} must look like section.field=value, e.g. --set model.d_model=256.")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        out[key.strip()] = value
    return out


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def changed_fields(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """The leaves that differ between two nested mappings, as {dotted.key: (old, new)}; None where a side
    lacks the key. For configs, pass `to_dict(cfg)`."""
    a, b = _flatten(old), _flatten(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _phases_name_dropped_domains(phases: list[dict], overrides: dict[str, Any]) -> bool:
    """Whether `--set data.domains=[...]` (without new phases) leaves `phases` naming domains that are gone."""
    domains = overrides.get("data.domains")
    if not isinstance(domains, list) or any(k.startswith("data.phases") for k in overrides):
        return False
    names = {d.get("name") for d in domains if isinstance(d, dict)}
    return any(name not in names for phase in phases for name in phase["weights"])


# What other stacks (Hugging Face configs, Megatron, MaxText) call a field moelab names otherwise.
ALIASES = {"top_k": "num_experts_per_token", "num_experts_per_tok": "num_experts_per_token",
           "moe_top_k": "num_experts_per_token", "num_local_experts": "num_experts", "n_routed_experts": "num_experts",
           "n_experts": "num_experts", "hidden_size": "d_model", "n_embd": "d_model", "emb_dim": "d_model",
           "num_hidden_layers": "num_layers", "n_layer": "num_layers", "num_attention_heads": "num_heads",
           "n_head": "num_heads", "num_key_value_heads": "num_kv_heads", "max_position_embeddings": "seq_len",
           "max_seq_len": "seq_len", "moe_intermediate_size": "expert_dim", "intermediate_size": "expert_dim",
           "learning_rate": "lr", "global_batch_size": "batch_size", "n_shared_experts": "num_shared_experts"}


def did_you_mean(name: str, choices: list[str]) -> str:
    """" (did you mean X?)" for the closest of `choices` to `name` (a known alias first); "" when none is close."""
    alias = ALIASES.get(name)
    if alias in choices:
        return f" (did you mean {alias}?)"
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def override(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """Apply dotted overrides (`{"model.moe.num_experts": 16}`) and re-validate the whole config."""
    data = to_dict(cfg)
    if _phases_name_dropped_domains(data["data"]["phases"], overrides):
        data["data"]["phases"] = []  # your own domains and no phases: the old ones (a preset's) named other domains
    for key, value in overrides.items():
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                path = ".".join(parts[: i + 1])
                options = ", ".join(node) if isinstance(node, dict) else "none"
                hint = did_you_mean(part, list(node)) if isinstance(node, dict) else ""
                raise ConfigError(f"Unknown key {path} in --set {key}=...{hint}; the keys allowed here are: {options}.")
            if i == len(parts) - 1:
                node[part] = value
            else:
                node = node[part]
    return from_dict(data)
