"""Parallelism (layer 2): the mesh and its shardings, and expert-parallel dispatch.

- `mesh`: the ("replica", "expert") mesh, the sharding rules, multi-host start.
- `ep`: the all-to-all expert-parallel backend, and `make_dispatch(cfg, mesh)`, the one entry point that
  builds any backend's dispatch.
"""
