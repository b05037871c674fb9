"""Multi-tenant traffic with shared system prompts, for the prefix-cache hit-rate benchmark
(`python -m loadtests.bench.cache`, `fairshare bench cache`).

Every request's prompt is built from three parts, in this order:

    [operator-wide public system prompt] [one of its tenant's own system prompts] [a private user turn]

- the public system prompt (`public_tokens`) is the same for every tenant: the text an operator
  would list with `--public-prefix-file` so tenants may share its KV blocks;
- each tenant has `system_prompts` system prompts of its own (`system_tokens` each) and picks one
  per request (uniformly), so a tenant repeats its prefixes but never another tenant's;
- the user turn is fresh random tokens (the `TenantLoad`'s `prompt_tokens` length), never shared.

Arrivals and user-turn / output lengths come from ordinary `TenantLoad`s (`fairshare.workloads`);
their rates follow a Zipf-like law (tenant k sends `rate / k`), as real tenant populations do: a few
heavy tenants that mostly hit their own cache, a long tail of light tenants that send a few
requests each and whose copies of the (long) public prompt compete for the same KV pool when each
tenant must hold its own. `SharedPrefixWorkload.requests(seed)` gives the requests with their
token ids, deterministic per seed. The plain `Workload` types carry only lengths, hence this
wrapper that adds the prompt content.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from fairshare.workloads import RequestSpec, TenantLoad, Workload

TOKEN_RANGE = (1000, 30000)  # ids drawn from here (inside the SmolLM2 vocabulary)


@dataclass(frozen=True)
class PromptedRequest:
    """A request with its prompt: `spec` (arrival, lengths; `spec.prompt_tokens` is the user turn's
    length), `token_ids` (the whole prompt), `system_index` (which of the tenant's system prompts)."""

    spec: RequestSpec
    token_ids: tuple[int, ...]
    system_index: int

    @property
    def tenant_id(self) -> str:
        return self.spec.tenant_id


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """`base`: arrivals and lengths (one `TenantLoad` per tenant). public_tokens / system_tokens:
    lengths of the public and of each tenant system prompt (tokens). system_prompts: system prompts
    per tenant (>= 1). prompt_seed: seed of the public and system prompts (None: the run's seed;
    fixed, the prompts stay the same whatever the seed of the arrivals)."""

    base: Workload
    public_tokens: int = 384
    system_prompts: int = 2
    system_tokens: int = 256
    prompt_seed: int | None = None

    @property
    def name(self) -> str:
        return self.base.name

    def public_prompt(self, seed: int = 0) -> tuple[int, ...]:
        """The operator-wide public system prompt (token ids)."""
        rng = random.Random(f"{seed}:public")
        return tuple(rng.randint(*TOKEN_RANGE) for _ in range(self.public_tokens))

    def system_prompt(self, tenant_id: str, index: int, seed: int = 0) -> tuple[int, ...]:
        """Tenant `tenant_id`'s `index`-th system prompt (token ids)."""
        rng = random.Random(f"{seed}:system:{tenant_id}:{index}")
        return tuple(rng.randint(*TOKEN_RANGE) for _ in range(self.system_tokens))

    def stretched(self, factor: float) -> "SharedPrefixWorkload":
        """The same workload played `factor` times slower: every rate divided by `factor`, the
        duration multiplied by it (about the same requests, spread over more time). Raises
        ValueError unless factor > 0."""
        if not factor > 0:
            raise ValueError("factor must be > 0")
        base = self.base
        tenants = tuple(replace(t, rate=t.rate / factor) for t in base.tenants)
        return replace(self, base=replace(base, tenants=tenants, duration_s=base.duration_s * factor))

    def lasting(self, duration_s: float) -> "SharedPrefixWorkload":
        """The same workload (same rates) over `duration_s` seconds. Raises ValueError unless > 0."""
        if not duration_s > 0:
            raise ValueError("duration_s must be > 0")
        return replace(self, base=replace(self.base, duration_s=float(duration_s)))

    def requests(self, seed: int = 0, rate_scale: float = 1.0) -> list[PromptedRequest]:
        """Every request with its prompt, in arrival order. Deterministic per seed."""
        ps = seed if self.prompt_seed is None else self.prompt_seed
        public = self.public_prompt(ps)
        systems = {t.tenant_id: [self.system_prompt(t.tenant_id, j, ps) for j in range(self.system_prompts)]
                   for t in self.base.tenants}
        rng = random.Random(f"{seed}:turns")
        out = []
        for spec in self.base.generate(seed, rate_scale):
            j = rng.randrange(self.system_prompts)
            user = tuple(rng.randint(*TOKEN_RANGE) for _ in range(spec.prompt_tokens))
            out.append(PromptedRequest(spec, public + systems[spec.tenant_id][j] + user, j))
        return out


def zipf_tenants(n: int, rate: float, user_tokens: tuple[int, int] = (32, 256), output_tokens: int = 64,
                 prefix: str = "t") -> tuple[TenantLoad, ...]:
    """`n` tenants `prefix`1..`prefix`n; tenant k sends Poisson arrivals at `rate / k` requests/s."""
    return tuple(TenantLoad(f"{prefix}{k}", rate / k, user_tokens, output_tokens) for k in range(1, n + 1))


SHARED_SYSTEM_PROMPTS = SharedPrefixWorkload(
    Workload("shared-system-prompts",
             "64 tenants (Zipf rates 6/k req/s, 60 s), each repeating 2 own 256-token system prompts after a "
             "1024-token operator-wide public system prompt (tool descriptions, policies), then a private "
             "32-256-token user turn",
             zipf_tenants(64, 6.0), duration_s=60.0, source="FairShare issue #7"),
    public_tokens=1024, system_prompts=2, system_tokens=256)

SMALL = SharedPrefixWorkload(
    Workload("shared-system-prompts-small", "4 tenants, short prompts (unit tests)",
             zipf_tenants(4, 2.0, user_tokens=(8, 40), output_tokens=8), duration_s=20.0, source="tests"),
    public_tokens=48, system_prompts=2, system_tokens=32)

WORKLOADS = {w.name: w for w in (SHARED_SYSTEM_PROMPTS, SMALL)}
