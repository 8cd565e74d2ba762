"""The click command line: `dsv41 --help`."""
