"""The front door's exception family."""


class CLIError(Exception):
    """Bad command-line input: the message names the problem and the fix."""
