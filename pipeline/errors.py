"""User-facing errors: one line that names the problem and the fix, exit code 2, no traceback."""
import argparse
import sys
from contextlib import contextmanager


class PipelineError(Exception):
    """An error caused by bad input or environment, reported as a single line.

    Raise it with a message of the form "<what is wrong>: <how to fix it>". The entry point
    prints it without a traceback (unless `hydra.verbose` is set) and exits non-zero.
    """


class OneLineParser(argparse.ArgumentParser):
    """argparse for the command-line tools: a bad argument is one line naming the tool and its --help, exit 2,
    like every other bad input (argparse's own error prints the usage block)."""

    def error(self, message):
        sys.stderr.write(f"[{self.prog.rsplit('.', 1)[-1]}] error: {message}: see {self.prog} --help\n")
        sys.exit(2)


@contextmanager
def one_line_errors(tool: str):
    """The command-line tools' rule for a PipelineError inside the block: `[tool] error: <message>` on stderr, exit 2."""
    try:
        yield
    except PipelineError as e:
        sys.stderr.write(f"[{tool}] error: {e}\n")
        sys.exit(2)


def require_positive(args, *names: str) -> None:
    """A PipelineError naming the first argparse destination in `names` whose value is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise PipelineError(f"--{name.replace('_', '-')} {getattr(args, name)} is not an integer >= 1")
