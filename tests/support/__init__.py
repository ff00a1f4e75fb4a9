"""Helpers that tests and benches share: appliances run through the CLI, small models, fake
peers, records. No tests and no fixtures live here (fixtures stay in the conftest files)."""
