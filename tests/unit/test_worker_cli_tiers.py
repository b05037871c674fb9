"""`fairshare worker --tier-min-share / --no-tier-scheduling / --iteration-token-target /
--lower-tier-token-target / --lower-tier-grace-iterations / --lower-tier-idle-token-target`: parsed into
EngineConfig fields that reach the scheduling core; bad values are argparse errors (exit 2, one
`error:` line, no traceback) before any model is loaded; `fairshare up` passes them on."""

from __future__ import annotations

import pytest

from worker.cli import build_parser, tier_settings
from worker.engine.engine import Engine, EngineConfig
from loadtests.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock


def settings(*argv: str) -> dict:
    p = build_parser()
    return tier_settings(p, p.parse_args(list(argv)))


def engine(**cfg) -> Engine:
    clock = VirtualClock()
    return Engine(SimModel(), EngineConfig(**cfg), SimulatedRunner(clock, IterationTimeModel(0.01, 0, 0, 0), 64),
                  clock=clock)


def test_defaults_are_the_engines_and_give_five_percent_per_lower_tier():
    s = settings()
    assert s == {"tier_scheduling": True, "tier_min_shares": {}, "iteration_token_target": None,
                 "lower_tier_token_target": 1, "tier_grace_iterations": 1024, "lower_tier_idle_token_target": 16}
    cfg = EngineConfig()
    assert {k: getattr(cfg, k) for k in s} == s
    core = engine().scheduler.core
    assert core.tiers.enabled and core.tiers.min_share == {"batch": 0.05, "background": 0.05}
    assert core.iteration_token_target == cfg.max_num_batched_tokens and core.lower_tier_token_target == 1
    assert (core.tier_grace_iterations, core.lower_tier_idle_token_target) == (1024, 16)


def test_flags_reach_the_scheduling_core():
    s = settings("--tier-min-share", "background=0.1", "--tier-min-share", "batch=0.02", "--iteration-token-target", "24",
                 "--lower-tier-token-target", "8", "--lower-tier-grace-iterations", "0",
                 "--lower-tier-idle-token-target", "64")
    assert s == {"tier_scheduling": True, "tier_min_shares": {"background": 0.1, "batch": 0.02},
                 "iteration_token_target": 24, "lower_tier_token_target": 8, "tier_grace_iterations": 0,
                 "lower_tier_idle_token_target": 64}
    core = engine(**s).scheduler.core
    assert core.tiers.min_share == {"batch": 0.02, "background": 0.1} and core.iteration_token_target == 24
    assert (core.lower_tier_token_target, core.tier_grace_iterations, core.lower_tier_idle_token_target) == (8, 0, 64)
    assert engine(**settings("--lower-tier-token-target", "0")).scheduler.core.lower_tier_token_target is None
    off = settings("--no-tier-scheduling")
    assert off["tier_scheduling"] is False and not engine(**off).scheduler.core.tiers.enabled


def test_fairshare_up_passes_tier_flags_to_its_worker(capsys):
    from fairshare.cli import up

    def worker_args(*argv: str) -> list[str]:
        args = up.build_parser().parse_args(list(argv))
        up.resolve_ports(args)
        cmd = up.worker_command(args)
        return cmd[cmd.index("worker") + 1:]

    assert not [a for a in worker_args() if a.startswith(("--tier", "--no-tier", "--iteration", "--lower-tier"))]
    args = worker_args("--tier-min-share", "background=0.1", "--iteration-token-target", "16", "--no-tier-scheduling")
    p = build_parser()
    ns = p.parse_args(args)
    assert ns.tier_min_share == [("background", 0.1)] and ns.iteration_token_target == 16 and ns.tier_scheduling is False
    args = worker_args("--tier-min-share", "background=0.1", "--iteration-token-target", "16",
                       "--lower-tier-token-target", "0", "--lower-tier-grace-iterations", "200")
    assert tier_settings(p, p.parse_args(args)) == {"tier_scheduling": True, "tier_min_shares": {"background": 0.1},
                                                    "iteration_token_target": 16, "lower_tier_token_target": None,
                                                    "tier_grace_iterations": 200, "lower_tier_idle_token_target": 16}
    with pytest.raises(SystemExit) as exc:
        up.build_parser().parse_args(["--tier-min-share", "background=2"])
    assert exc.value.code == 2 and "--tier-min-share" in capsys.readouterr().err
