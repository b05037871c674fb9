"""Scheduling policy (framework-free: no torch, no grpc): service cost and fair-share policies."""

from worker.scheduling.cost import LinearCost
from worker.scheduling.policy import FCFSPolicy, SchedulingPolicy, TenantAccount, VTCPolicy, make_policy

__all__ = ["LinearCost", "FCFSPolicy", "SchedulingPolicy", "TenantAccount", "VTCPolicy", "make_policy"]
