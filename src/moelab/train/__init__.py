"""One run (layer 3): it takes sinks and watchers as arguments and imports no `ladder` or `lab`.

- `state`: TrainState and the optimizer; `schedule`: learning-rate schedules.
- `loop`: the train step, eval, and the run that resumes and writes its outputs.
- `checkpoint`: Orbax saves sealed by a checksum manifest; `weights`: a finished run's params.
- `monitor`: norms and spike incidents; `contingency`: re-planning after lost compute.
- `memory_plan`: a step's memory and traffic per device (`moelab plan`); `run_length`: its step time and days.
- `outputs`: the run directory's contract; `publish`: copying it to object storage on a cadence.
"""
