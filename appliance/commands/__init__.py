"""The core's command groups, one module each. The root (appliance.cli) lists them from its table
and imports a module only when one of its commands runs."""
