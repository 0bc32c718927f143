"""The native package's exception family."""


class NativeError(ValueError):
    """A kernel cannot run as asked (unsupported type, wrong shape/dtype/device, a bad tuning
    variable): says which and why. The extensions raise it for their argument checks."""
