"""FairShare: multi-tenant LLM serving with weighted fair scheduling (VTC).

What both tiers share lives here: the tenant config schema, the tier vocabulary
(`fairshare.tiers`), the generated gRPC stubs
(`fairshare.v1`) and the `fairshare` command line.
"""

__version__ = "0.1.0"
