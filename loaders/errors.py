"""The loaders package's exception family: every error a model file (or its template) can cause."""


class GGUFError(Exception):
    """A model file (or a request about one) is wrong: the message says what, where, and the fix."""


class ChatTemplateError(GGUFError):
    """A chat template cannot be compiled or rendered, or went past a rendering limit."""
