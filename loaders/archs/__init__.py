"""Architectures we run; each module registers itself with loaders.registry on import."""
