"""The scaling ladder: rungs, scaling-law fits and on-track predictions.

- `rungs`: ladder generation from a recipe and compute budgets.
- `fit`: the compute envelope L(C), Chinchilla's L(N, D) and the schedule-aware curve law fitted on
  every checkpoint of every rung, with a bootstrap over whole runs.
- `predict`: the CURVES.csv / TARGET.csv -> PRED.csv contract, bands, the on-track monitor and
  compute-equivalent speedups.

The package needs numpy and scipy only (no JAX), so a laptop can refit a ladder from a CSV.
"""

# Refits behind a band: enough that the 2.5% / 97.5% quantiles rest on ~5 refits each. Here rather
# than in `fit` so that the CLI can show the default without importing scipy (0.8 s) at start-up.
NUM_BOOTSTRAP = 200
# The curve law's annealing form and band method `ladder fit` uses unless told otherwise: chosen on real public
# curves by a rule fixed before scoring (docs/scaling-ladder.md, "Real public curves").
DEFAULT_LAW = "tissue"
DEFAULT_BAND = "calibrated"
