"""Where the `cadence` package is imported from, for child processes that must import it too."""

import os

# The folder that holds the `cadence` package: site-packages when installed, the checkout otherwise.
# Child processes (actor processes, learner hosts, Ray workers) put it on PYTHONPATH so they import
# this same copy even when Cadence is not installed.
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
