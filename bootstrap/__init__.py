"""A long-lived DHT-only peer with a stable identity that others join through."""
