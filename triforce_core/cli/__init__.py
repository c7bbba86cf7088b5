"""The `triforce` command line (click): flag parsing only; work happens in triforce.*."""
