"""Synthetic workloads after Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024), §5.2 (synthetic workloads): constant overload with 2 and 8 clients, proportional
under-load, on/off clients, short-prompt/long-output against long-prompt/short-output, increasing
load and weighted clients. Rates in requests/s for a server of about 2 requests/s of 256/256
(see `fairshare.workloads.REFERENCE_CAPACITY_RPS`)."""

from __future__ import annotations

from fairshare.workloads import TenantLoad, Workload

SRC = "VTC paper (Sheng et al., OSDI 2024) §5.2"

OVERLOAD = Workload(
    "overload", "2 clients at 1.5 and 3 req/s, 256 in / 256 out: both above their fair share",
    (TenantLoad("client1", 1.5), TenantLoad("client2", 3.0)), source=SRC)

OVERLOAD_8 = Workload(
    "overload-8", "8 clients from 0.25 to 2 req/s, 256 in / 256 out: 9 req/s in all",
    tuple(TenantLoad(f"client{i + 1}", 0.25 * (i + 1)) for i in range(8)), source=SRC)

PROPORTIONAL = Workload(
    "proportional", "3 clients at 0.3, 0.6 and 0.9 req/s (256/256), together under capacity: each should get "
    "its demand", tuple(TenantLoad(f"client{i + 1}", 0.3 * (i + 1)) for i in range(3)), source=SRC)

ON_OFF = Workload(
    "on-off", "client1 sends 2 req/s throughout; client2 sends 1 req/s for 30 s on, 30 s off (a returning "
    "tenant)", (TenantLoad("client1", 2.0), TenantLoad("client2", 1.0, on_off_s=(30.0, 30.0))),
    source=SRC, returning_tenant="client2")

SHORT_LONG = Workload(
    "short-long", "long prompt / short output (512/32 at 8 req/s) against short prompt / long output "
    "(32/512 at 1.5 req/s)",
    (TenantLoad("long-prompt", 8.0, 512, 32), TenantLoad("long-output", 1.5, 32, 512)), source=SRC)

INCREASING = Workload(
    "increasing", "client1 at 1 req/s; client2 ramps from 0.2 to 3 req/s",
    (TenantLoad("client1", 1.0), TenantLoad("client2", 0.2, rate_end=3.0)), source=SRC)

WEIGHTED = Workload(
    "weighted", "4 clients with weights 1, 2, 3, 4, each at 1.5 req/s (256/256): service should follow the weights",
    tuple(TenantLoad(f"w{i + 1}", 1.5, weight=float(i + 1)) for i in range(4)), source=SRC + " (weighted VTC, §4.3)")

WORKLOADS = [OVERLOAD, OVERLOAD_8, PROPORTIONAL, ON_OFF, SHORT_LONG, INCREASING, WEIGHTED]
