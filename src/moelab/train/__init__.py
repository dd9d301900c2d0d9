"""One run (layer 3): it takes sinks and watchers as arguments and imports no `ladder` or `lab`.

- `state`: TrainState and the optimizer; `schedule`: learning-rate schedules.
- `step`: the jitted train and eval steps; `resume`: where a run starts and which config changes it may make;
  `loop`: the run that drives them and writes its outputs.
- `checkpoint`: Orbax saves sealed by a checksum manifest; `weights`: a finished run's params.
- `monitor`: norms and spike incidents; `contingency`: re-planning after lost compute.
- `memory_plan`: a step's memory per device (`moelab plan`), its activations traced by `residuals`; `traffic`: the
  bytes it sends by link; `hlo`: the compiled step's own figures; `run_length`: its step time and days.
- `outputs`: the run directory's contract; `publish`: copying it to object storage on a cadence.
"""
