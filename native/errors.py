"""The native package's exception family."""


class NativeError(Exception):
    """A kernel cannot run as asked (unsupported type, wrong shape/dtype/device): says which and why."""
