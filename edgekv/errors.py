class EdgeKVError(Exception):
    """An error for the user: the CLI prints its message as one line and exits non-zero."""


class ContextOverflow(EdgeKVError):
    pass
