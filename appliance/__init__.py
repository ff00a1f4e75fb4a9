"""The appliance's shared core: state directory, settings, secrets, supervised programs.

Nothing is imported here: `import appliance.home` must not build the settings' schemas, so the CLI
and every supervised program load only the modules they use."""
