"""swarmnode: serve a large language model across a peer-to-peer swarm.

The node daemon and what every peer shares live here: DHT records (`records`), RPC messages (`messages`),
the block runtime (`runtime/`), the RPC server (`server/`) and the command line (`cli/`). The client
library is `swarmnode.client`, the placement planner `swarmnode.planner`, the DHT-only bootstrap peer
`swarmnode.bootstrap`.
"""

__version__ = "0.1.0"
