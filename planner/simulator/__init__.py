"""The discrete-event serving simulator: the event loop (``engine``), how a plan becomes servers and routers
(``serving``, ``routers``), what is measured (``metrics``), request traces (``trace``), and planning then
scoring a cluster in one call (``scoring``).
"""
