"""`python -m moelab.cli ARGS` runs `moelab ARGS`."""

from moelab.cli.main import main

main()
