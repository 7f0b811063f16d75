"""The cost models a plan can be scored with, by name: one factory for the command line, specs and code.

* ``roofline`` (:class:`planner.costs.roofline.CostModel`): HexGen Eqs. 4-7 on each node's specs (FLOPS, memory
  bandwidth, NIC) or its measured ``block_throughput``; works for any hardware, CPU nodes measured live by
  the coordinator included. Its departures from Helix's own model are listed in ``docs/planner.md``.
* ``helix`` (:class:`planner.costs.helix_profiled.HelixCostModel`): Helix's model as its published code runs it:
  per-layer batch times measured on each GPU kind, vLLM's KV-cache room, the typical batch of one prompt plus
  rescaled decode tokens and the speed-weighted share of requests (Helix-ASPLOS25
  ``simulator/model_manager/<model>/``). Nodes Helix did not profile (CPU nodes, measured nodes) keep the
  roofline figures; :meth:`~planner.costs.roofline.CostModel.sources` says which node uses what.

Every model has the interface of :class:`~planner.costs.roofline.CostModel` (``capacity``, ``table``,
``link_capacity``, ``batch_seconds``, ``kv_token_layers``, ``batch_limits``), so the flow graph, the MILP and
the baselines take either; the last three are a node's batch times, KV room and batch caps for a serving
simulator.
"""

from __future__ import annotations

from ..cluster.spec import COST_MODEL_NAMES, Cluster, Workload
from ..errors import PlannerError
from .roofline import CostModel, CostParams

__all__ = ["COST_MODELS", "make_cost_model", "resolve_cost"]

#: Every cost model by name, the default first.
COST_MODELS = COST_MODEL_NAMES


def make_cost_model(
    cluster: Cluster,
    name: str | None = None,
    *,
    params: CostParams | None = None,
    workload: Workload | None = None,
) -> CostModel:
    """The cost model ``name`` (default: the spec's ``cost_model``, itself ``roofline`` by default) bound
    to ``cluster`` and ``workload`` (default: the cluster's)."""
    name = cluster.cost_model if name is None else name
    if name == "roofline":
        return CostModel(cluster, params, workload)
    if name == "helix":
        from .helix_profiled import HelixCostModel

        return HelixCostModel(cluster, params, workload)
    raise PlannerError(
        f"unknown cost model {name!r}; choose one of {', '.join(COST_MODELS)}", code="bad_option"
    )


def resolve_cost(
    cluster: Cluster,
    cost: CostModel | None = None,
    cost_model: str | None = None,
    cost_params: CostParams | None = None,
) -> CostModel:
    """The cost model to score ``cluster`` with: ``cost`` when given (``cost_model``, if also given, must
    name it), else :func:`~planner.costs.factory.make_cost_model` of ``cost_model`` (default: the spec's
    ``cost_model``) with ``cost_params``."""
    if cost is None:
        return make_cost_model(cluster, cost_model, params=cost_params)
    if cost_model is not None and cost_model != cost.name:
        raise PlannerError(
            f"cost is a {cost.name!r} cost model but cost_model={cost_model!r}; pass one of them",
            code="bad_option",
        )
    return cost
