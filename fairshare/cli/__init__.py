"""The top of the house: the `fairshare` command line and what only it runs.

Nothing below imports this package (tests/unit/test_import_layers.py checks it): the gateway, the
worker and the shared contract (`fairshare.*` outside `fairshare.cli`) never reach up here.

- `main`: the `fairshare` console script; dispatches sub-commands lazily (`fairshare gateway` never
  imports torch).
- `up`, `up_flags`, `supervisor`: `fairshare up` (Redis + workers + gateway on one machine, supervised).
- `top`, `scrape`: `fairshare top` (a live per-tenant view from the Prometheus endpoints).
- `bench`, `sim`, `loadtest`: the `fairshare bench | sim | loadtest` commands; the benchmarks,
  reports and campaigns they run live in `loadtests`.
"""
