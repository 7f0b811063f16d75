"""The planning algorithms, one per module (listed by name in :mod:`planner.registry`).

Node placement: ``milp`` (Helix's MILP; its models in ``milp_formulations``), ``petals`` and
``swarm_baseline`` (the Petals and SWARM-paper baselines as Helix ran them), ``ahp`` (LLaMPS' OPA) and
``gma`` (LLaMPS' GMA). Replica groups: ``hexgen``, ``hexgen2`` (with its flow scoring in ``hexgen2_flow``),
and ``hexgen2_swarm`` (HexGen-2 adapted to a live swarm's nodes).
"""
