"""Cost models: what a node, a link or a GPU stage costs.

* ``roofline`` — HexGen Eqs. 4-7 on each node's specs (the ``roofline`` cost model, :class:`CostModel`);
* ``helix_profiled`` — Helix's cost model from measured per-layer batch times (the ``helix`` cost model);
* ``factory`` — the cost models by name (``make_cost_model``, ``resolve_cost``);
* ``hexgen_gpus`` — the GPU-level view of a cluster and HexGen's per-stage costs (HexGen, HexGen-2);
* ``replica_figures`` — HexGen's latency (Eq. 2) and memory (Eq. 7) of one planned replica.
"""
