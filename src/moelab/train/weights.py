"""A run's weights for use after training: the newest valid checkpoint's params and router bias, the
run's config and its tokenizer (what `moelab generate`, `eval` and `export` read).

    run = load_run("runs/tiny")            # DataError naming the folder and the fix if it cannot
    logits, _ = transformer.apply(run.params, tokens, run.cfg.model, run.router_bias,
                                  dispatch=build_moe(run.cfg.model, purpose="decode"))  # moelab.model.moe

The checkpoint is restored onto one device whatever mesh trained it (inference on a laptop of a run
trained expert-parallel). The tokenizer is, in order: the byte tokenizer (`data.tokenizer: byte`),
an explicit `tokenizer` path, `OUT/tokenizer.json` (written by training since issue 18), the
tokenizer.json the config names, or the token store's. A run trained with `bpe` before runs saved
their tokenizer has none of these: that is a DataError asking for `--tokenizer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax

from moelab.config import RunConfig, load_yaml
from moelab.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from moelab.errors import ConfigError, DataError
from moelab.train import outputs
from moelab.train.checkpoint import Checkpointer
from moelab.train.state import init_state

__all__ = ["RunWeights", "checkpoint_steps", "load_run", "load_tokenizer"]


class RunWeights(NamedTuple):
    cfg: RunConfig
    params: Any  # nested dict of float32 arrays, as `transformer.init` returns
    router_bias: jax.Array  # [L, E]
    step: int  # the checkpoint's step
    tokenizer: Tokenizer


def load_tokenizer(out: Path, cfg: RunConfig, tokenizer: Path | None = None) -> Tokenizer:
    """The run's tokenizer (see the module docstring for the order); DataError if there is none."""
    if tokenizer is not None:
        return HFTokenizer.load(tokenizer)
    if cfg.data.tokenizer == "byte":
        return ByteTokenizer()
    candidates = [out / outputs.TOKENIZER]
    if cfg.data.tokenizer.endswith(".json"):
        candidates.append(Path(cfg.data.tokenizer))
    stores = {d.store or cfg.data.store for d in cfg.data.domains} - {None}
    candidates += [Path(s) / "tokenizer.json" for s in sorted(stores) if "://" not in s]
    for path in candidates:
        if path.is_file():
            return HFTokenizer.load(path)
    raise DataError(f"run {out} has no tokenizer: data.tokenizer is {cfg.data.tokenizer!r} and none of "
                    f"{', '.join(str(p) for p in candidates)} exists (runs trained before issue 18 did not save "
                    "theirs). Pass the tokenizer.json it was trained with, e.g. --tokenizer STORE/tokenizer.json.")


def load_run(out: str | Path, tokenizer: Path | None = None, step: int | None = None) -> RunWeights:
    """The run in `out` at its newest valid checkpoint (or at `step`), on one device; DataError if `out` has
    none (or `step` is not a valid checkpoint of it).

    Args:
        out: a run directory written by `moelab train` (`config.yaml`, `checkpoints/`).
        tokenizer: a tokenizer.json to use instead of the run's own.
        step: a checkpoint step (`checkpoint_steps`) instead of the newest.
    """
    out = Path(out)
    config = out / outputs.CONFIG
    if not config.is_file():
        found = _runs_below(out)
        hint = (f"The runs below it: {', '.join(str(p) for p in found)}; give one of those." if found else
                "Give the --out folder of a `moelab train` run: it holds config.yaml and checkpoints/ (e.g. "
                "runs/tiny after `moelab train --preset tiny --out runs/tiny`).")
        raise DataError(f"{out} is not a moelab run: {config} does not exist. {hint}")
    try:
        cfg = load_yaml(config)
    except ConfigError as e:
        raise DataError(f"{config} does not load as a run config: {str(e).rstrip('.')}.") from None
    ckpt_dir = out / outputs.CHECKPOINTS
    if not ckpt_dir.is_dir() or not any(p.name.isdigit() for p in ckpt_dir.iterdir()):
        raise DataError(f"run {out} has no checkpoint in {ckpt_dir}: it has not saved one yet. Train it "
                        f"(`moelab train {config} --out {out}`) or give another run.")
    tok = load_tokenizer(out, cfg, tokenizer)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                        jax.eval_shape(lambda: init_state(cfg)))
    checkpoints = Checkpointer(ckpt_dir, cfg.checkpoint, read_only=True)  # the run may still be training
    try:
        restored = checkpoints.restore_newest(like=like) if step is None else checkpoints.restore(step, like)
    finally:
        checkpoints.close()
    if restored is None and step is not None:
        raise DataError(f"run {out} has no valid checkpoint at step {step} in {ckpt_dir}; its steps are "
                        f"{checkpoint_steps(out)}.")
    if restored is None:
        raise DataError(f"run {out} has no valid checkpoint in {ckpt_dir} (each one failed its manifest check, "
                        "or is a save still in progress); train it again to save one, or wait for the save.")
    state = restored.state
    return RunWeights(cfg, state.params, state.router_bias, restored.step, tok)


def _runs_below(folder: Path, depth: int = 3, most: int = 5) -> list[Path]:
    """Run folders (a config.yaml beside checkpoints/) at most `depth` levels below `folder`, the first `most`
    in sorted order: what to suggest for a folder that holds runs, such as a lab root or a ladder's."""
    found = []
    for level in range(1, depth + 1):
        pattern = "/".join(["*"] * level) + "/" + outputs.CONFIG
        found += [p.parent for p in folder.glob(pattern) if (p.parent / outputs.CHECKPOINTS).is_dir()]
    return sorted(found)[:most]


def checkpoint_steps(out: str | Path) -> list[int]:
    """The steps of the checkpoints saved in run `out`, oldest first (sealed or not: `load_run` checks)."""
    ckpt_dir = Path(out) / outputs.CHECKPOINTS
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.is_dir() else []
