"""Placement planner (pure: no network, no torch)."""
