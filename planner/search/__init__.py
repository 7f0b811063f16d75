"""Search machinery the algorithms share: the MILP's search portfolio (``portfolio``), coverage beams and
large-neighbourhood search (``coverage``), the flow beam (``flow_beam``), throughput upper bounds
(``bounds``), the redundancy floor (``redundancy``), graph partitioning (``partition``) and the sparse
HiGHS model builder (``milp_model``).
"""
