"""The compiler's figures: the real train step compiled on abstract arrays (nothing allocated or run), and the
bytes its collectives send, read off the HLO by link.

    figures = hlo.compile_in_subprocess(cfg)          # XLA's memory and collectives on simulated CPU devices
    by_link = hlo.collective_bytes_by_link(compiled_text, 8, 4)  # {"in_rack": {kind: bytes}, "across_racks": ...}

What `moelab plan --compile`, `benchmarks/plan_vs_xla.py` and `benchmarks/comm_links.py` check the planner
(`memory_plan`, `traffic`) against; it counts in the planner's terms (`traffic.ring`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import RunConfig, from_dict, to_dict
from moelab.parallel import mesh as mesh_lib
from moelab.train.state import init_state, state_shardings
from moelab.train.step import make_train_step
from moelab.train.traffic import ring

__all__ = ["COLLECTIVES", "LINKS", "replica_groups", "spans_racks", "collective_bytes", "collective_bytes_by_link",
           "compile_step", "compiled_figures", "compile_in_subprocess"]

COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8}


def _shape_bytes(types: str) -> int:
    """Bytes of an HLO type or tuple of types, e.g. `(f32[1,13,32]{2,1,0}, s32[1,13]{1,0})`."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", types):
        if dtype in _DTYPE_BYTES:
            total += math.prod(int(d) for d in filter(None, dims.split(","))) * _DTYPE_BYTES[dtype]
    return total


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of one collective, as positions in the mesh's device order: listed `{{0,1},{2,3}}`, the iota
    form `[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)`, the mesh form `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`, a
    collective-permute's `source_target_pairs`; one group of all `num_devices` when it names none."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if mesh:
        sizes = {axis: int(size) for axis, size in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))}
        names = list(sizes)
        over = set(re.findall(r"'(\w+)'", mesh.group(2)))
        ids = np.arange(num_devices).reshape([sizes[a] for a in names])
        kept = [i for i, a in enumerate(names) if a in over]
        moved = np.moveaxis(ids, kept, list(range(len(names) - len(kept), len(names))))
        return moved.reshape(-1, math.prod(sizes[names[i]] for i in kept)).tolist()
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        return ids.reshape(-1, shape[-1]).tolist()
    listed = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if listed and listed.group(1) != "{}":
        return [[int(d) for d in group.split(",")] for group in re.findall(r"\{([\d,]+)\}", listed.group(1))]
    if "source_target_pairs=" in line:
        return [[int(d) for d in pair.split(",")] for pair in re.findall(r"\{(\d+,\d+)\}", line)]
    return [list(range(num_devices))]


def _group_size(line: str, num_devices: int) -> int:
    """Devices in each replica group of a collective (a collective-permute: 2, a sender and a receiver)."""
    if "source_target_pairs=" in line:
        return 2
    return len(replica_groups(line, num_devices)[0])


def spans_racks(line: str, num_devices: int, rack_size: int) -> bool:
    """Whether any group of a collective holds devices of two racks (mesh positions p // rack_size differ)."""
    return any(len({d // rack_size for d in group}) > 1 for group in replica_groups(line, num_devices))


def _wire_bytes(kind: str, result: int, n: int) -> float:
    """Bytes one device sends for a collective whose result on it is `result` bytes, over groups of `n`
    (ring algorithms: an all-reduce is a reduce-scatter and an all-gather)."""
    if n <= 1:
        return 0
    return {"all-to-all": ring(result, n), "all-gather": ring(result, n), "reduce-scatter": ring(result * n, n),
            "all-reduce": 2 * ring(result, n), "collective-permute": result}[kind]


def collective_bytes(hlo: str, num_devices: int) -> dict[str, int]:
    """Bytes one device sends per execution of an HLO module's entry computation, by kind of collective.

    Walks from ENTRY: a collective (or its async `-start`) adds what it sends (`_wire_bytes`, from its
    result and its group size); a while loop adds its body's total times its `known_trip_count` (an
    unknown trip count raises rather than guessing); a conditional adds its largest branch; any other
    called computation adds its total once.
    """
    found = _walk(hlo, num_devices, lambda line: "")
    return {kind: int(found.get((kind, ""), 0)) for kind in COLLECTIVES}


LINKS = ("in_rack", "across_racks")


def collective_bytes_by_link(hlo: str, num_devices: int, rack_size: int) -> dict[str, dict[str, int]]:
    """`collective_bytes` split by link: {"in_rack": {kind: bytes}, "across_racks": {kind: bytes}}. A collective
    whose groups hold devices of two racks (`spans_racks`; a rack is `rack_size` consecutive mesh positions, the
    mesh's "expert" axis) crosses the network; every other stays on the rack's links."""
    found = _walk(hlo, num_devices,
                  lambda line: LINKS[spans_racks(line, num_devices, rack_size)])
    return {link: {kind: int(found.get((kind, link), 0)) for kind in COLLECTIVES} for link in LINKS}


def _walk(hlo: str, num_devices: int, link: Any) -> Counter:
    """{(kind, link(line)): bytes one device sends} over one execution of the entry computation (`collective_bytes`)."""
    computations: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif current is not None and line.startswith("  "):
            computations[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    @functools.cache
    def total(name: str) -> Counter:
        count: Counter = Counter()
        for line in computations[name]:
            op = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.*?) ([a-z\-]+)\(", line)
            if not op:
                continue
            result, opcode = op.groups()
            kind = opcode.removesuffix("-start")
            if kind in COLLECTIVES:
                count[(kind, link(line))] += _wire_bytes(kind, _shape_bytes(result), _group_size(line, num_devices))
            elif opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                if trips is None:
                    raise ValueError(f"while loop {body} has no known trip count; cannot count its collectives")
                for k, v in total(body).items():
                    count[k] += int(trips.group(1)) * v
            elif opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", line).group(1)
                count += max((total(b.strip().lstrip("%")) for b in branches.split(",")), key=lambda c: sum(c.values()))
            else:
                for called in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", line):
                    count += total(called)
        return count

    return total(entry)


def compile_step(cfg: RunConfig) -> Any:
    """`make_train_step(cfg, mesh)` lowered and compiled on abstract inputs; the devices must exist
    (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)."""
    mesh = mesh_lib.make_mesh(cfg.mesh)
    shapes = jax.eval_shape(lambda: init_state(cfg))
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                         state_shardings(cfg, mesh))
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32,
                                  sharding=mesh_lib.batch_sharding(mesh))
    lowered = make_train_step(cfg, mesh).lower(state, tokens, jnp.float32(jnp.inf))
    # LLVM's optimizations would double the compile time; they come after the HLO passes that place the
    # collectives and assign the buffers, so the figures read here are the same without them.
    return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})


def compiled_figures(cfg: RunConfig) -> dict[str, Any]:
    """XLA's per-device memory (`memory_analysis`) and collective bytes of the compiled step, and the compile time."""
    started = time.perf_counter()
    compiled = compile_step(cfg)
    seconds = time.perf_counter() - started
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"total": int(total), "arguments": int(m.argument_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
            "outputs_not_aliased": int(m.output_size_in_bytes - m.alias_size_in_bytes),
            "collectives": collective_bytes(compiled.as_text(), cfg.mesh.num_devices), "compile_seconds": round(seconds, 1)}


def compile_in_subprocess(cfg: RunConfig, timeout: float = 1800) -> dict[str, Any]:
    """`compiled_figures(cfg)` in a fresh Python on `cfg.mesh.num_devices` simulated CPU devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={cfg.mesh.num_devices}".strip()}
    done = subprocess.run([sys.executable, "-m", "moelab.train.hlo"], input=json.dumps(to_dict(cfg)),
                          capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {cfg.name} on {cfg.mesh.num_devices} simulated devices failed:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # the child of compile_in_subprocess: a config's JSON on stdin, figures on stdout
    print(json.dumps(compiled_figures(from_dict(json.loads(sys.stdin.read())))))
