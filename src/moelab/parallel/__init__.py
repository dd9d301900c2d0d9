"""Parallelism (layer 2): the mesh and its shardings, and the step's per-device program.

- `mesh`: the ("replica", "expert") mesh, the sharding rules (`leaf_spec`, the `mesh.shard` layouts), multi-host start.
- `spmd`: the loss and its gradient per device under one `shard_map`: parameters gathered in the rack, the
  gradient summed over the mesh once a step.
- `ep`: one MoE layer on a mesh from a global program (`moe_on_mesh`), for the layer's tests and benchmark.
"""
