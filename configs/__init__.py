"""quest's Hydra configs. In a checkout they live here, at the top level; an installed quest ships them as the
package ``quest.configs`` (pyproject.toml maps this folder there), which the apps find as ``pkg://quest.configs``."""
