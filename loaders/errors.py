"""The loaders package's exception family."""


class GGUFError(Exception):
    """A model file (or a request about one) is wrong: the message says what, where, and the fix."""
