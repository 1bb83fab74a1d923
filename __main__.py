"""``python -m gndpo``: the ``gndpo`` command, as the stage processes `gndpo run` starts are launched."""

from gndpo.cli.app import main

# The guard matters: vLLM starts its engine workers with spawn, which re-imports this module.
if __name__ == "__main__":
    main()
