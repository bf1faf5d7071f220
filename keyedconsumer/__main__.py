"""``python -m keyedconsumer``: the ``keyedconsumer`` command (see :mod:`keyedconsumer.cli`)."""

from .cli import main

if __name__ == "__main__":
    main()
