"""dropless.core: what every layer stands on — configuration, errors, the mesh and its sharding rules, XLA flags."""
