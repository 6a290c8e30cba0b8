"""The one exception type users see: a one-line message that names the file, field or value at fault."""


class FlashdraftError(Exception):
    """A problem with the user's input or environment, reported as one line without a traceback."""
