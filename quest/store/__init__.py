"""Every file quest writes or reads back: atomic writes, locks, what a command wrote, typed records."""
