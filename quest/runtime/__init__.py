"""The process quest runs in: its errors and exit codes, worker processes, optional packages, the process group."""
