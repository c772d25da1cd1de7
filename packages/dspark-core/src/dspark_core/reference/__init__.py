"""The reference DSpark draft: its config, its stock model and its TP sharding."""
