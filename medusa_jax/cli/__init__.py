"""The commands: argument parsing, printing and exit codes only. Nothing outside this package
imports it."""
