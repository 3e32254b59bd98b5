"""The one error type for mistakes a user can make and fix (config, data, model folders).

The CLI prints a ``UserError`` as one line, without a traceback, and exits with status 2.
The message says what was wrong, where (file, row, column or config key) and how to fix it.
"""


class UserError(ValueError):
    """A problem in the user's config, data or files, with a message that names the fix."""
