"""The one exception type users see: a bad model directory, file, flag or prompt."""


class OffloadError(Exception):
    """A problem with the user's input, reported as one line naming the file, field or value.

    The CLI prints `error: <message>` and exits with status 2; the Python API raises it as is.
    """
