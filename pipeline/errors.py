"""User-facing errors: one line that names the problem and the fix, exit code 2, no traceback."""
import argparse
import sys


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
