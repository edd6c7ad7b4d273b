"""User-facing errors: one line that names the problem and the fix, exit code 2, no traceback."""


class PipelineError(Exception):
    """An error caused by bad input or environment, reported as a single line.

    Raise it with a message of the form "<what is wrong>: <how to fix it>". The entry point
    prints it without a traceback (unless `hydra.verbose` is set) and exits non-zero.
    """
