"""The one exception type users see.

Anything the user can fix (a bad flag, a missing file, a corrupt image) is raised as
:class:`UserError`; the CLI entry points turn it into a single line on stderr and a
non-zero exit code instead of a traceback.
"""


class UserError(Exception):
    """A problem with the user's input, reported as one line.

    Parameters
    ----------
    message : str
        What is wrong, naming the flag or file.
    exit_code : int
        Process exit code used by the CLI (2 = bad usage, like argparse).
    """

    def __init__(self, message, exit_code=2):
        super().__init__(message)
        self.exit_code = exit_code
