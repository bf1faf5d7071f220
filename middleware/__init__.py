"""Middleware built only on the public handler API of :mod:`keyedconsumer`.

Installed as ``keyedconsumer.middleware``. A middleware takes a handler and returns a handler of the
same kind (sync or async); the first one given to ``KeyedConsumer`` is the outermost.
"""

__all__: list[str] = []
