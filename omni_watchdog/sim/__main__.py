"""`python -m omni_watchdog.sim`: the simulated server without the main command line."""

import sys


def main() -> int:
    # Imported here: spawned stage processes import this module as their main and must
    # not pay for the server's imports.
    import argparse

    from omni_watchdog.sim.cli import add_arguments, run

    parser = argparse.ArgumentParser(prog="python -m omni_watchdog.sim")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
