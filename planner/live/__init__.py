"""Re-planning a live swarm (used by the coordinator): sticky re-plans that move few blocks (``sticky``,
``sticky_phases`` for two-phase swarms) and why a node is left unused (``unused``).
"""
