"""The cluster a plan is made for: typed cluster specs (``spec``), the specs shipped in ``planner/clusters/``
(``shipped``), seeded synthetic swarms (``synthetic``) and Helix's measured GPU profiles (``helix_profiles``).
"""
