"""Why the FreeToken patch will not apply (a CLIError: the command line prints one line)."""
from ..errors import CLIError


class PatchRefused(CLIError):
    """The installed FreeToken is not the one the patch was written for, or a file changed."""
