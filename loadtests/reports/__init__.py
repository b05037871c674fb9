"""Report writers: Markdown tables and PNG plots from simulator runs and Locust campaigns.

- `fairness`: `fairshare sim report` (docs/fairness-report.md): every workload under every policy.
- `tiers`, `quota`, `pool`: its tier, KV-quota and pool sections (also runnable on their own).
- `loadtest`: `fairshare loadtest`'s per-tenant report of a campaign (Locust records + worker samples).
- `common`: what they share (percentiles, table cells, the matplotlib backend).
"""
