"""The commands that look at an OUT, finished or not, and write none of its output files: status, inspect,
report and export. The CLI (tokpipe/cli.py) parses and dispatches them."""
