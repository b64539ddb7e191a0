"""The toy study's configs (``quest-toy`` / ``python -m quest.toy``), shipped as ``quest.configs.toy``."""
