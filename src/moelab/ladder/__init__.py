"""The scaling ladder: rungs, scaling-law fits and on-track predictions.

Modules, each importing only those above it:

- `laws`: the compute envelope L(C) and Chinchilla's L(N, D), fitted across finished runs.
- `curve`: the schedule-aware curve law L(N, t) and the runs (`Run`) it reads.
- `fit`: fitting the curve law on every checkpoint of every rung, with its weights and prior.
- `contract`: the CURVES.csv / TARGET.csv -> PRED.csv contract and PRED.json, its sidecar.
- `bands`: the bootstrap, the noise a new run adds, and the bands around a prediction.
- `calibrate`: widening the bands by the law's misfit on runs it did not see.
- `forecast`: the live forecast of a run's final loss from its evals so far.
- `drift`: how the law's miss moves over a run of each schedule shape, read off the curves for the forecast.
- `rungs`: rungs from a recipe and compute budgets; the checks `ladder plan` warns with.
- `fix`: resolving those warnings (`ladder plan --fix`).
- `predict`: `fit_curves`, the whole prediction: fit, bands, self-check, summary, PRED.csv.
- `on_track`: the on-track watcher, each eval of a training run against its predicted band.
- `speedup`: the compute-equivalent speedup of one recipe's ladder over another's.
- `task`, `task_points`: the target's downstream task accuracy from the rungs' checkpoints.
- `run`: a ladder end to end: plan, train the rungs, fit, predict (`ladder run`, the lab's steps).

Fitting and predicting need numpy and scipy only (no JAX), so a laptop can refit a ladder from a CSV.
This file imports none of its modules, so importing `moelab.ladder` for the defaults below costs nothing.
"""

# Refits behind a band: enough that the 2.5% / 97.5% quantiles rest on ~5 refits each. Here rather
# than in `bands` so that the CLI can show the default without importing scipy (0.8 s) at start-up.
NUM_BOOTSTRAP = 200
# The curve law's annealing form and band method `ladder fit` uses unless told otherwise: chosen on real public
# curves by a rule fixed before scoring (docs/scaling-ladder.md, "Real public curves"; "The noise an anneal
# removes"). Where no size has runs at two peak LRs per token of batch, it fits exactly as "tissue" does.
DEFAULT_LAW = "noise-temperature"
DEFAULT_BAND = "calibrated"
