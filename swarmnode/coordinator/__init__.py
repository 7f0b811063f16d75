"""The coordinator's planning: live node records -> planner cluster -> a sticky, explained placement."""
