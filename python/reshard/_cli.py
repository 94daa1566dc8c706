"""The ``reshard`` command installed with the Python package: the same command line as the
Rust binary (it runs the library's own CLI code through the native module)."""

import signal
import sys


def main() -> None:
    """Run ``reshard`` with ``sys.argv`` and exit with its status (0, 1 or 2)."""
    from ._reshard import cli_main

    # Behave like the binary: Ctrl-C ends the process (the output is committed atomically,
    # so an interrupted run leaves nothing behind but its staging area, which the next run
    # clears), and a closed pipe is the CLI's to handle.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(cli_main(["reshard", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
