"""The simulator: the real engine loop (`worker.engine.engine.Engine`, its `Scheduler` and the
`worker.scheduling` policies) driven by a simulated runner on a virtual clock.

- `runner.py`: `VirtualClock`, `IterationTimeModel`, `SimulatedRunner` (no torch), `ClockedRunner`.
- `calibrate.py`: fits the iteration time model from the real runner (needs torch).
- `driver.py`: runs a workload (fairshare/workloads) under a policy and records an `EventLog`.
- `pool.py`: a pool of simulated workers behind the gateway's routing policy.

The reports written from these runs (fairness, tiers, KV quotas, pool) live in `loadtests/reports`,
the benchmarks that use the simulator in `loadtests/bench`.

CLI: `fairshare sim calibrate|run|report` (fairshare/cli/sim.py).
"""
