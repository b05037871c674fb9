"""Benchmarks: each prints figures (`fairshare bench NAME`, dispatched by `fairshare.cli.bench`), none is
imported by a serving package (tests/unit/test_import_layers.py checks it).

- `engine`: the reference engine's decode throughput, side by side with llama.cpp and transformers.
- `gateway`: the gateway's overhead against an in-process echo worker.
- `cache`: prefix-cache hit rates by isolation mode (cache replay, or the engine on the simulator).
- `sidechannel`, `sidechannel_stats`: case CI2, the TTFT timing side channel across tenants (the driver;
  its statistics: paired and pooled ROC AUC of TTFT, pure Python).
- `recovery`, `chaos`: `fairshare up` healing kills; mixed load while its parts are killed.
- `grammar`: the cost of grammar-constrained decoding.
- `scheduler`, `weights`: the scheduling core's decision time; what a weight means when nobody queues.
"""
