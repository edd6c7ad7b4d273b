class PipelineError(Exception):
    """Bad input or environment, reported as one line "<what is wrong>: <how to fix it>", exit 2, no traceback
    (unless `hydra.verbose` is set)."""
