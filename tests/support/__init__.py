"""Test-only support code: the worker launcher with its test-control service, its client, the wait
helper and the CI skip rule. Nothing here is imported by the product."""
