"""Where each step of the training transform runs (``data.pipeline``), and the transforms themselves."""
