"""The config: its schema, the checks of overrides and values, ``--help``, Hydra's registration."""
